#!/usr/bin/env python3
"""Nightshift benchmarks (`just bench`): run against the release binary on this machine.

  upload     a 100 MB upload through `nightshift serve`: wall time and the server's peak RSS
  parts      a 200 MB input through the Uploads API in 64 MB parts (create, 4 parts,
             complete with an MD5): wall time and the server's peak RSS
  validate   creating a batch over a 200 MB, 50,000-line input: wall time and peak RSS,
             against a naive reference (Python, json.loads per line) on the same file
  refused    3,000 batch creates refused by validation: what they add to the server's
             memory (RSS) and to its data directory, and the time of a listing after them
  tinyparts  5,000 one-byte parts added to one upload: the time of a part at the start and
             at the end (adding one should cost the same however many there are)
  silent     4,100 connections that never send a byte, from one address: whether a client
             from another address is still served, how fast, and how long they stay open
  s3         batches on S3 storage (s3s-fs, as `tests/run` installs it), where every commit
             is an object of its own: 50,000 lines with the echo model, and 5,000 at an
             upstream that answers in 300 ms (fixed 256): create to completed, finalizing to
             completed, the server's peak RSS

Usage: bench/run.py [upload] [parts] [validate] [refused] [tinyparts] [silent] [s3]   (all when none named)
NIGHTSHIFT_BINARY names another binary (an older build, to compare).
"""

import asyncio
import hashlib
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
BINARY = pathlib.Path(os.environ.get("NIGHTSHIFT_BINARY", ROOT / "target" / "release" / "nightshift"))
MB = 1024 * 1024


def rss_mb(pid):
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def disk_mb(path):
    result = subprocess.run(["du", "-sk", str(path)], check=True, capture_output=True, text=True)
    return int(result.stdout.split()[0]) / 1024


def peak_rss_mb(pid):
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


def own_metrics_address():
    """`--metrics-listen` for binaries that have it (older ones served /metrics on the API)."""
    help_text = subprocess.run([str(BINARY), "serve", "--help"], capture_output=True, text=True).stdout
    return ["--metrics-listen", "127.0.0.1:0"] if "--metrics-listen" in help_text else []


class Serve:
    def __init__(self, data_dir, config=None):
        args = ["--config", str(config)] if config else []
        # No data directory: the configuration's storage (S3) is used.
        args += ["--data-dir", str(data_dir)] if data_dir else []
        self.process = subprocess.Popen(
            [str(BINARY), "serve", "--listen", "127.0.0.1:0", *own_metrics_address(), *args],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "RUST_LOG": "warn"},
        )
        for line in self.process.stdout:
            if line.strip().startswith("x-project-id:"):
                self.project = line.split(":", 1)[1].strip()
            if line.strip().startswith("x-api-key:"):
                self.key = line.split(":", 1)[1].strip()
            if line.startswith("Nightshift listening on "):
                self.url = line.split()[-1]
                break

    def headers(self):
        return {"x-project-id": self.project, "x-api-key": self.key}

    def rss(self):
        return peak_rss_mb(self.process.pid)

    def stop(self):
        self.process.kill()
        self.process.wait()


def request_line(n, pad, model="echo"):
    body = {"model": model, "messages": [{"role": "user", "content": f"question {n} " + "x" * pad}]}
    return json.dumps({"custom_id": f"req-{n}", "method": "POST", "url": "/v1/chat/completions", "body": body})


def write_input(path, lines, size):
    """`lines` requests padded so the file is about `size` bytes."""
    pad = max(0, size // lines - len(request_line(0, 0)) - 8)
    with open(path, "w") as f:
        for n in range(lines):
            f.write(request_line(n, pad) + "\n")
    return path.stat().st_size


def upload(serve, path):
    result = subprocess.run(
        ["curl", "-sS", "-X", "POST", f"{serve.url}/v1/files",
         "-H", f"x-project-id: {serve.project}", "-H", f"x-api-key: {serve.key}",
         "-F", "purpose=batch", "-F", f"file=@{path}"],
        check=True, capture_output=True, text=True,
    )
    return json.loads(result.stdout)


def bench_upload(work):
    path = work / "upload.jsonl"
    size = write_input(path, 25_000, 100 * MB - 64 * 1024)
    serve = Serve(work / "upload-data")
    try:
        baseline = serve.rss()
        started = time.perf_counter()
        uploaded = upload(serve, path)
        elapsed = time.perf_counter() - started
        assert uploaded["bytes"] == size, uploaded
        print(f"upload: {size / MB:.1f} MB in {elapsed:.2f} s ({size / MB / elapsed:.0f} MB/s); "
              f"server peak RSS {serve.rss():.1f} MB (idle {baseline:.1f} MB)")
    finally:
        serve.stop()


def post_json(serve, path, body):
    request = urllib.request.Request(
        f"{serve.url}{path}", data=json.dumps(body).encode(), method="POST",
        headers={**serve.headers(), "content-type": "application/json"},
    )
    with urllib.request.urlopen(request) as answer:
        return json.load(answer)


def bench_parts(work):
    path = work / "parts.jsonl"
    size = write_input(path, 50_000, 200 * MB - 64 * 1024)
    part_size = 64 * MB
    pieces = []
    with open(path, "rb") as f:
        while chunk := f.read(part_size):
            piece = work / f"part-{len(pieces)}"
            piece.write_bytes(chunk)
            pieces.append(piece)
    md5 = hashlib.md5(path.read_bytes()).hexdigest()
    serve = Serve(work / "parts-data")
    try:
        baseline = serve.rss()
        started = time.perf_counter()
        upload = post_json(serve, "/v1/uploads",
                           {"bytes": size, "filename": "parts.jsonl", "purpose": "batch", "mime_type": "application/jsonl"})
        part_ids = []
        for piece in pieces:
            result = subprocess.run(
                ["curl", "-sS", "-X", "POST", f"{serve.url}/v1/uploads/{upload['id']}/parts",
                 "-H", f"x-project-id: {serve.project}", "-H", f"x-api-key: {serve.key}", "-F", f"data=@{piece}"],
                check=True, capture_output=True, text=True,
            )
            part_ids.append(json.loads(result.stdout)["id"])
        done = post_json(serve, f"/v1/uploads/{upload['id']}/complete", {"part_ids": part_ids, "md5": md5})
        elapsed = time.perf_counter() - started
        assert done["status"] == "completed" and done["file"]["bytes"] == size, done
        print(f"parts: {size / MB:.1f} MB in {len(pieces)} parts in {elapsed:.2f} s ({size / MB / elapsed:.0f} MB/s); "
              f"server peak RSS {serve.rss():.1f} MB (idle {baseline:.1f} MB)")
    finally:
        serve.stop()


def plant_file(data_dir, project, path):
    """Registers `path` as a file of `project` directly in storage: uploads stop at 100 MB,
    and the validation limit is 200 MB."""
    file_id = "file-01BENCHMARK0000000000000"
    (data_dir / "file-data" / project).mkdir(parents=True, exist_ok=True)
    (data_dir / "file-meta" / project).mkdir(parents=True, exist_ok=True)
    os.link(path, data_dir / "file-data" / project / file_id)
    record = {"id": file_id, "project_id": project, "bytes": path.stat().st_size,
              "created_at": int(time.time()), "filename": path.name, "purpose": "batch"}
    (data_dir / "file-meta" / project / f"{file_id}.json").write_text(json.dumps(record))
    return file_id


def naive_reference(path):
    """What a straightforward implementation does: json.loads every line."""
    started = time.perf_counter()
    seen = set()
    with open(path, "rb") as f:
        for raw in f:
            line = json.loads(raw)
            assert isinstance(line, dict) and line["custom_id"] not in seen
            seen.add(line["custom_id"])
            assert line["method"].upper() == "POST" and line["url"] == "/v1/chat/completions"
            assert isinstance(line["body"], dict) and line["body"] and line["body"].get("stream") is not True
    return time.perf_counter() - started


def bench_validate(work):
    path = work / "validate.jsonl"
    size = write_input(path, 50_000, 200 * MB - 256 * 1024)
    # The batches created here should not run: their model goes to an upstream that
    # is never reached, one line at a time, so execution does not muddy the numbers.
    config = work / "validate.yaml"
    project = "3f6c1f4e-8b8f-4b59-9a55-0d6f1b8a2e11"
    config.write_text(
        f"projects:\n  - id: {project}\n    api_keys: [{{plain: bench}}]\n"
        "upstreams:\n  - name: parked\n    base_url: http://127.0.0.1:9/v1\n    max_concurrency: 1\n"
        "    retry_base_delay: 60s\n"
    )
    timings, peaks = [], []
    for run in range(3):
        data_dir = work / f"validate-data-{run}"
        serve = Serve(data_dir, config)
        serve.project, serve.key = project, "bench"
        try:
            file_id = plant_file(data_dir, project, path)
            body = json.dumps({"input_file_id": file_id, "endpoint": "/v1/chat/completions"}).encode()
            request = urllib.request.Request(f"{serve.url}/v1/batches", data=body, method="POST",
                                             headers={**serve.headers(), "content-type": "application/json"})
            started = time.perf_counter()
            with urllib.request.urlopen(request) as response:
                batch = json.load(response)
            timings.append(time.perf_counter() - started)
            peaks.append(serve.rss())
            assert batch["status"] == "in_progress" and batch["request_counts"]["total"] == 50_000, batch
        finally:
            serve.stop()
    best = min(timings)
    reference = naive_reference(path)
    print(f"validate: {size / MB:.1f} MB, 50,000 lines in {best:.3f} s best of 3 "
          f"({size / MB / best:.0f} MB/s; runs {', '.join(f'{t:.3f}' for t in timings)}); "
          f"server peak RSS {max(peaks):.1f} MB")
    print(f"validate: naive Python json.loads per line {reference:.3f} s; Nightshift is {reference / best:.1f}x faster")


def bench_refused(work):
    refused = int(os.environ.get("BENCH_REFUSED", "3000"))
    data_dir = work / "refused-data"
    serve = Serve(data_dir)
    try:
        bad = work / "bad.jsonl"
        bad.write_text("".join(request_line(n, 0) + "\n" for n in range(20)) + "not json\n")
        file_id = upload(serve, bad)["id"]
        body = json.dumps({"input_file_id": file_id, "endpoint": "/v1/chat/completions"}).encode()
        time.sleep(1)
        rss_before, disk_before = rss_mb(serve.process.pid), disk_mb(data_dir)
        started = time.perf_counter()
        for _ in range(refused):
            request = urllib.request.Request(f"{serve.url}/v1/batches", data=body, method="POST",
                                             headers={**serve.headers(), "content-type": "application/json"})
            try:
                urllib.request.urlopen(request)
                raise AssertionError("the create was not refused")
            except urllib.error.HTTPError as error:
                assert error.code == 400, error.code
        elapsed = time.perf_counter() - started
        time.sleep(1)
        rss_after, disk_after = rss_mb(serve.process.pid), disk_mb(data_dir)
        listing = []
        for _ in range(20):
            request = urllib.request.Request(f"{serve.url}/v1/batches?limit=20", headers=serve.headers())
            started_list = time.perf_counter()
            with urllib.request.urlopen(request) as response:
                assert len(json.load(response)["data"]) == 20
            listing.append(time.perf_counter() - started_list)
        listing.sort()
        print(f"refused: {refused:,} refused creates in {elapsed:.1f} s; server RSS {rss_before:.1f} -> "
              f"{rss_after:.1f} MB (+{rss_after - rss_before:.1f}), data directory {disk_before:.1f} -> "
              f"{disk_after:.1f} MB (+{disk_after - disk_before:.1f}); list of 20 after them: median "
              f"{listing[len(listing) // 2] * 1000:.1f} ms")
    finally:
        serve.stop()


def bench_tinyparts(work):
    import http.client

    serve = Serve(work / "tinyparts-data")
    parts = 5_000
    try:
        upload = post_json(serve, "/v1/uploads",
                           {"bytes": parts, "filename": "tiny.jsonl", "purpose": "batch", "mime_type": "application/jsonl"})
        host, port = serve.url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port))
        body = b"--b\r\nContent-Disposition: form-data; name=\"data\"; filename=\"p\"\r\n\r\nx\r\n--b--\r\n"
        headers = {**serve.headers(), "content-type": "multipart/form-data; boundary=b"}
        times = []
        for _ in range(parts):
            started = time.perf_counter()
            connection.request("POST", f"/v1/uploads/{upload['id']}/parts", body=body, headers=headers)
            answer = connection.getresponse()
            answer.read()
            assert answer.status == 200, answer.status
            times.append(time.perf_counter() - started)
        first, last = sorted(times[:200]), sorted(times[-200:])
        print(f"tinyparts: {parts} one-byte parts; median time of a part: the first 200 "
              f"{first[100] * 1000:.2f} ms, the last 200 {last[100] * 1000:.2f} ms; server peak RSS {serve.rss():.1f} MB")
    finally:
        serve.stop()


def bench_silent(work):
    import resource
    import socket

    resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))
    serve = Serve(work / "silent-data")
    host, port = serve.url.removeprefix("http://").split(":")
    silent = []
    try:
        for n in range(4_100):
            connection = socket.socket()
            connection.setblocking(False)
            connection.connect_ex((host, int(port)))
            silent.append(connection)
            if n % 128 == 127:
                time.sleep(0.05)  # the listen backlog drops SYNs that come all at once
        time.sleep(3)
        listing = subprocess.run(["ss", "-tnH", "state", "established", f"( sport = :{port} )"],
                                 capture_output=True, text=True).stdout
        held = len(listing.splitlines())
        started = time.perf_counter()
        probe = socket.create_connection((host, int(port)), timeout=40, source_address=("127.0.0.2", 0))
        probe.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        try:
            answer = probe.recv(64)
        except TimeoutError:
            answer = b""
        waited = time.perf_counter() - started
        served = answer.startswith(b"HTTP/1.1 200")
        # How long the silent ones stay open: poll until the server has closed them all.
        open_after, opened = None, time.perf_counter()
        while time.perf_counter() - opened < 60:
            still = 0
            for connection in silent:
                try:
                    if connection.recv(1) == b"":
                        continue
                except BlockingIOError:
                    still += 1
                except OSError:
                    continue
            if still == 0:
                open_after = time.perf_counter() - opened + 1
                break
            time.sleep(1)
        closed = f"all closed by the server {open_after:.0f} s after opening" if open_after else "still open after 60 s"
        print(f"silent: 4,100 silent connections from 127.0.0.1 ({held} held by the server); a client from 127.0.0.2 "
              f"{'served' if served else 'NOT served'} after {waited:.2f} s; {closed}")
    finally:
        for connection in silent:
            connection.close()
        serve.stop()


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def slow_upstream(delay):
    """An OpenAI-compatible upstream that answers every request after `delay` seconds
    (HTTP/1.1 with keep-alive, in a thread of its own); returns its base URL."""
    answer = json.dumps({"id": "slow", "object": "chat.completion", "created": 1, "model": "slow",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}).encode()
    response = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                + str(len(answer)).encode() + b"\r\n\r\n" + answer)

    async def connection(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                await asyncio.sleep(delay)
                writer.write(response)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    ready = threading.Event()
    port = []

    def run():
        async def main():
            server = await asyncio.start_server(connection, "127.0.0.1", 0, backlog=1024)
            port.append(server.sockets[0].getsockname()[1])
            ready.set()
            await server.serve_forever()
        asyncio.run(main())

    threading.Thread(target=run, daemon=True).start()
    ready.wait()
    return f"http://127.0.0.1:{port[0]}/v1"


def bench_s3(work):
    cache = pathlib.Path(os.environ.get("NIGHTSHIFT_CACHE", pathlib.Path.home() / ".cache" / "nightshift"))
    s3s_fs = cache / "tools" / "bin" / "s3s-fs"
    if not s3s_fs.exists():
        print(f"s3: skipped, {s3s_fs} is missing (tests/run installs it)")
        return
    project, key = "3f6c1f4e-8b8f-4b59-9a55-0d6f1b8a2e11", "bench"
    slow = slow_upstream(0.3)
    # `serve` reaches s3s-fs with these (Serve passes the environment on).
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench-secret", AWS_REGION="us-east-1")
    for name, lines, model in [("echo", 50_000, "echo"), ("300-ms upstream", 5_000, "slow")]:
        root = work / f"s3-{model}"
        (root / "s3" / "nightshift").mkdir(parents=True)
        port = free_port()
        store = subprocess.Popen([str(s3s_fs), "--host", "127.0.0.1", "--port", str(port), "--access-key", "bench",
                                  "--secret-key", "bench-secret", str(root / "s3")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        config = root / "nightshift.yaml"
        config.write_text(
            f"projects:\n  - id: {project}\n    api_keys: [{{plain: {key}}}]\n"
            f"storage:\n  s3: {{bucket: nightshift, endpoint: \"http://127.0.0.1:{port}\", path_style: true}}\n"
            f"upstreams:\n  - name: slow\n    base_url: {slow}\n    models: [slow]\n    max_concurrency: 256\n"
            "    adaptive: false\n"
        )
        serve = Serve(None, config)
        serve.project, serve.key = project, key
        try:
            path = root / "input.jsonl"
            with open(path, "w") as f:
                for n in range(lines):
                    f.write(request_line(n, 200, model) + "\n")
            file_id = upload(serve, path)["id"]
            started = time.perf_counter()
            batch = post_json(serve, "/v1/batches", {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                      "completion_window": "24h"})
            finalizing = None
            while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(0.05)
                request = urllib.request.Request(f"{serve.url}/v1/batches/{batch['id']}", headers=serve.headers())
                with urllib.request.urlopen(request) as answer:
                    batch = json.load(answer)
                if batch["status"] == "finalizing" and finalizing is None:
                    finalizing = time.perf_counter()
            done = time.perf_counter()
            assert batch["status"] == "completed" and batch["request_counts"]["completed"] == lines, batch
            finalize = f"{done - finalizing:.2f} s" if finalizing else "under a poll"
            print(f"s3: {lines:,} lines, {name}: created to completed in {done - started:.2f} s, finalizing to "
                  f"completed {finalize}; server peak RSS {serve.rss():.1f} MB")
        finally:
            serve.stop()
            store.kill()
            store.wait()


def main():
    chosen = sys.argv[1:] or ["upload", "parts", "validate", "refused", "tinyparts", "silent", "s3"]
    if not BINARY.exists():
        sys.exit(f"{BINARY} is missing: run `cargo build --release` first (just bench does)")
    with tempfile.TemporaryDirectory(prefix="nightshift-bench-") as work:
        work = pathlib.Path(work)
        for name in chosen:
            {"upload": bench_upload, "parts": bench_parts, "validate": bench_validate,
             "refused": bench_refused, "tinyparts": bench_tinyparts, "silent": bench_silent,
             "s3": bench_s3}[name](work)


if __name__ == "__main__":
    main()
