"""Webhooks verified by the official OpenAI Python SDK (run by tests/serve/sdk_e2e.rs): a batch
run through the SDK (configured only by its environment variables) sends `batch.completed`
to the receiver here; its first delivery is answered 500, and the retry carries the same
`webhook-id`; `client.webhooks.unwrap(...)` checks the signature and types the event."""

import http.server
import os
import threading
import time

import openai
from openai import OpenAI

client = OpenAI(max_retries=0)
SECRET = os.environ["WEBHOOK_SECRET"]
received = []


class Hook(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        received.append((dict(self.headers.items()), body))
        self.send_response(500 if len(received) == 1 else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["WEBHOOK_PORT"])), Hook)
threading.Thread(target=server.serve_forever, daemon=True).start()

lines = "".join(
    f'{{"custom_id": "hook-{n}", "method": "POST", "url": "/v1/chat/completions", '
    f'"body": {{"model": "echo", "messages": [{{"role": "user", "content": "hi {n}"}}]}}}}\n'
    for n in range(2)
)
file = client.files.create(file=("hook.jsonl", lines.encode()), purpose="batch")
batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")

deadline = time.time() + 60
while len(received) < 2:
    assert time.time() < deadline, f"webhook deliveries: {received}"
    time.sleep(0.2)

(first_headers, _), (headers, body) = received[0], received[1]
assert first_headers["webhook-id"] == headers["webhook-id"], (first_headers, headers)
event = client.webhooks.unwrap(body, headers, secret=SECRET)
assert event.type == "batch.completed", event
assert event.data.id == batch.id, (event, batch.id)
assert event.id == headers["webhook-id"], event

# A tampered body, or the wrong secret, does not verify.
for payload, secret in [(body.replace(b"completed", b"cancelled"), SECRET),
                        (body, "whsec_" + "A" * 32)]:
    try:
        client.webhooks.unwrap(payload, headers, secret=secret)
        raise AssertionError("a bad signature verified")
    except openai.InvalidWebhookSignatureError:
        pass
print("webhooks SDK checks passed")
