"""The Uploads API through the official OpenAI Python SDK, configured only by its
environment variables (run by tests/serve/sdk_e2e.rs): a 150 MB batch input, past the 100 MB
file upload limit, sent with `client.uploads.upload_file_chunked` in 64 MB parts, checked
by MD5, then run as a batch; and the refusals the SDK raises as typed errors."""

import hashlib
import json
import os
import pathlib
import tempfile
import time

import openai
from openai import OpenAI

client = OpenAI(max_retries=0, timeout=600)
MB = 1024 * 1024

# 150 MB of requests, 1,500 lines of about 100 KB each.
path = pathlib.Path(tempfile.mkdtemp()) / "big input.jsonl"
md5 = hashlib.md5()
with open(path, "wb") as f:
    for n in range(1500):
        body = {"model": "echo", "max_tokens": 4, "messages": [{"role": "user", "content": f"q{n} " + "x" * 100_000}]}
        line = json.dumps({"custom_id": f"big-{n}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        data = (line + "\n").encode()
        md5.update(data)
        f.write(data)
size = path.stat().st_size
assert 140 * MB < size < 160 * MB, size

# A single file upload stops at 100 MB: that is what uploads are for.
try:
    client.files.create(file=path, purpose="batch")
    raise AssertionError("a 150 MB file upload was accepted")
except openai.APIStatusError as e:
    assert e.status_code == 413 and e.code == "file_too_large", e

upload = client.uploads.upload_file_chunked(
    file=path, mime_type="application/jsonl", purpose="batch", md5=md5.hexdigest()
)
assert upload.status == "completed", upload
assert upload.file is not None and upload.file.bytes == size, upload
assert upload.file.filename == "big input.jsonl", upload.file
print(f"uploaded {size} bytes in {-(-size // (64 * MB))} parts as {upload.file.id}")

content = client.files.content(upload.file.id)
assert hashlib.md5(content.read()).hexdigest() == md5.hexdigest()

batch = client.batches.create(input_file_id=upload.file.id, endpoint="/v1/chat/completions", completion_window="24h")
deadline = time.time() + 300
while batch.status not in ("completed", "failed", "expired", "cancelled"):
    assert time.time() < deadline, batch
    time.sleep(0.5)
    batch = client.batches.retrieve(batch.id)
assert batch.status == "completed", batch
assert batch.request_counts.total == 1500 and batch.request_counts.completed == 1500, batch.request_counts

# Refusals, typed as the SDK types them.
small = client.uploads.create(bytes=6, filename="s.jsonl", mime_type="text/jsonl", purpose="batch")
part = client.uploads.parts.create(upload_id=small.id, data=b"{}\n{}\n")
try:
    client.uploads.complete(upload_id=small.id, part_ids=[part.id], md5="0" * 32)
    raise AssertionError("a wrong md5 was accepted")
except openai.BadRequestError as e:
    assert e.code == "md5_mismatch" and e.param == "md5", e
try:
    client.uploads.complete(upload_id=small.id, part_ids=["part_unknown"])
    raise AssertionError("an unknown part was accepted")
except openai.BadRequestError as e:
    assert e.code == "invalid_part_id", e
cancelled = client.uploads.cancel(small.id)
assert cancelled.status == "cancelled", cancelled
try:
    client.uploads.parts.create(upload_id=small.id, data=b"{}\n")
    raise AssertionError("a part was added to a cancelled upload")
except openai.BadRequestError as e:
    assert e.code == "upload_cancelled", e
try:
    client.uploads.create(bytes=201 * MB, filename="huge.jsonl", mime_type="application/jsonl", purpose="batch")
    raise AssertionError("an upload past the 200 MB input limit was accepted")
except openai.BadRequestError as e:
    assert e.code == "file_too_large" and e.param == "bytes", e
try:
    client.uploads.complete(upload_id="upload_nosuch", part_ids=["part_x"])
    raise AssertionError("an unknown upload was found")
except openai.NotFoundError as e:
    assert e.code == "upload_not_found", e

print("uploads SDK checks passed")
