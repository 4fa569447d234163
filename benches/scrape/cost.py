"""What a load-signal reading costs a server that renders its metrics in Python (vLLM,
SGLang, TensorRT-LLM, through Prometheus's Python client), with the whole page and with
the samples a reading names (`?name[]=`), as `nightshift` asks. Run by hand:

    python3 -m venv /tmp/scrape && /tmp/scrape/bin/pip install prometheus_client uvicorn httpx
    /tmp/scrape/bin/python benches/scrape/cost.py

1. The render: a registry shaped like vLLM V1's (its metric families and buckets, one
   engine and four, max_model_len 32768, with prometheus-fastapi-instrumentator's HTTP
   metrics and the client's process and GC collectors), scraped over HTTP from uvicorn;
   the server's CPU a scrape.
2. Beside users: the same registry in an API server of vLLM's shape (one Python process;
   a chat route that awaits its engine 50 ms), with 0, 1, 4 and 16 readers each reading
   every 50 ms (as worker pods do) and one user sending a request every 20 ms: the
   server's CPU and the user's p50 and p99. The readers and the user run on the same
   machine as the server.
"""
import asyncio, json, os, random, subprocess, sys, time

import httpx
import prometheus_client as pc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary

# What `nightshift` asks for with the `vllm` preset.
NAMES = ["vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
         "vllm:gpu_cache_usage_perc", "vllm:inter_token_latency_seconds_sum",
         "vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_sum",
         "vllm:time_per_output_token_seconds_count"]


def buckets_1_2_5(most):
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, … up to `most`."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > most:
                return out
            out.append(mantissa * scale)
        scale *= 10


def build(engines):
    """A registry with vLLM V1's metric families (vllm/v1/metrics/loggers.py), each engine
    with some traffic observed, and prometheus-fastapi-instrumentator's defaults."""
    registry = CollectorRegistry()
    pc.ProcessCollector(registry=registry)
    pc.PlatformCollector(registry=registry)
    pc.GCCollector(registry=registry)
    labels, model = ["model_name", "engine"], "meta-llama/Llama-3.1-8B-Instruct"
    tokens = buckets_1_2_5(32768)
    latency = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
    gauges = [Gauge(name, "", labels, registry=registry) for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc")]
    counters = [Counter(name, "", labels, registry=registry) for name in (
        "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits", "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens")]
    success = Counter("vllm:request_success", "", labels + ["finished_reason"], registry=registry)
    histograms = [Histogram(name, "", labels, buckets=buckets, registry=registry) for name, buckets in (
        ("vllm:request_prompt_tokens", tokens),
        ("vllm:request_generation_tokens", tokens),
        ("vllm:iteration_tokens_total", [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]),
        ("vllm:request_max_num_generation_tokens", tokens),
        ("vllm:request_params_n", [1, 2, 5, 10, 20]),
        ("vllm:request_params_max_tokens", tokens),
        ("vllm:time_to_first_token_seconds", [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                              1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]),
        ("vllm:time_per_output_token_seconds", [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                                                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]),
        ("vllm:time_per_prefill_token_request_seconds", [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
                                                         1.0]),
        ("vllm:e2e_request_latency_seconds", latency),
        ("vllm:request_queue_time_seconds", latency),
        ("vllm:request_inference_time_seconds", latency),
        ("vllm:request_prefill_time_seconds", latency),
        ("vllm:request_decode_time_seconds", latency),
    )]
    info = Gauge("vllm:cache_config_info", "", ["block_size", "cache_dtype", "gpu_memory_utilization",
                                                "num_gpu_blocks", "enable_prefix_caching", "engine"],
                 registry=registry)
    for engine in map(str, range(engines)):
        info.labels("16", "auto", "0.9", "27000", "True", engine).set(1)
        for gauge in gauges:
            gauge.labels(model, engine).set(random.random() * 10)
        for counter in counters:
            counter.labels(model, engine).inc(random.randint(1, 10**6))
        for reason in ("stop", "length", "abort"):
            success.labels(model, engine, reason).inc(random.randint(1, 1000))
        for histogram in histograms:
            for _ in range(50):
                histogram.labels(model, engine).observe(random.random() * 100)
    requests = Counter("http_requests_total", "", ["handler", "method", "status"], registry=registry)
    request_size = Summary("http_request_size_bytes", "", ["handler"], registry=registry)
    response_size = Summary("http_response_size_bytes", "", ["handler"], registry=registry)
    highr = Histogram("http_request_duration_highr_seconds", "", registry=registry, buckets=[
        0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5, 10, 30, 60])
    duration = Histogram("http_request_duration_seconds", "", ["handler", "method"], buckets=[0.1, 0.5, 1],
                         registry=registry)
    for handler in ("/v1/chat/completions", "/v1/completions", "/v1/models"):
        for status in ("2xx", "4xx"):
            requests.labels(handler, "POST", status).inc(5)
        request_size.labels(handler).observe(100)
        response_size.labels(handler).observe(100)
        duration.labels(handler, "POST").observe(0.3)
        highr.observe(0.3)
    return registry


def app(engines):
    import uvicorn
    metrics = pc.make_asgi_app(registry=build(engines))

    async def api(scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/metrics"):
            return await metrics(scope, receive, send)
        if scope["type"] == "http":
            await asyncio.sleep(0.05)
            body = json.dumps({"choices": [{"message": {"content": "hi"}}]}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
        elif scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})

    uvicorn.run(api, host="127.0.0.1", port=PORT, log_level="warning", access_log=False)


PORT = 9319
URL = f"http://127.0.0.1:{PORT}"


def cpu(pid):
    fields = open(f"/proc/{pid}/stat").read().split(")")[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def params(named):
    return [("name[]", name) for name in NAMES] if named else None


def render(pid, engines):
    with httpx.Client() as client:
        for named in (False, True):
            for _ in range(50):
                client.get(f"{URL}/metrics", params=params(named))
            n, before, size = 2000, cpu(pid), 0
            for _ in range(n):
                size = len(client.get(f"{URL}/metrics", params=params(named)).content)
            each = (cpu(pid) - before) / n
            print(f"| {engines} | {'named' if named else 'whole'} | {size:,} | {each * 1e3:.2f} | {each * 2000:.1f}% |")


async def beside_users(pid, readers, named, seconds=15.0):
    latencies = []

    async def reader(client, stop):
        while time.perf_counter() < stop:
            start = time.perf_counter()
            await client.get(f"{URL}/metrics", params=params(named))
            await asyncio.sleep(max(0.0, 0.05 - (time.perf_counter() - start)))

    async def user(client, stop):
        while time.perf_counter() < stop:
            start = time.perf_counter()
            await client.post(f"{URL}/v1/chat/completions", json={})
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.02)

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=100)) as client:
        stop, before = time.perf_counter() + seconds, cpu(pid)
        await asyncio.gather(user(client, stop), *[reader(client, stop) for _ in range(readers)])
        used = (cpu(pid) - before) / seconds
    latencies.sort()
    at = lambda q: latencies[int(len(latencies) * q)] * 1000
    print(f"| {readers} | {'named' if named else 'whole'} | {used * 100:.1f}% | {at(0.5):.1f} ms | {at(0.99):.1f} ms |")


def started(engines):
    server = subprocess.Popen([sys.executable, __file__, "serve", str(engines)])
    for _ in range(100):
        try:
            httpx.get(f"{URL}/metrics", params=params(True))
            return server
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit("the stand-in did not start")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        app(int(sys.argv[2]))
        raise SystemExit
    print("| engines | page | bytes | server CPU a scrape (ms) | at 20 scrapes/s |\n| --- | --- | --- | --- | --- |")
    for engines in (1, 4):
        server = started(engines)
        render(server.pid, engines)
        server.terminate(); server.wait()
    print("\n| readers | page | server CPU | user p50 | user p99 |\n| --- | --- | --- | --- | --- |")
    server = started(1)
    for readers in (0, 1, 4, 16):
        for named in (False, True) if readers else (False,):
            asyncio.run(beside_users(server.pid, readers, named))
    server.terminate(); server.wait()
