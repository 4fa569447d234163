"""A batch through the official SDK, `nightshift serve` and a real model server
(llama.cpp's llama-server): every line answered once, usage summed from its answers.

Environment: NIGHTSHIFT_URL, NIGHTSHIFT_PROJECT_ID, NIGHTSHIFT_API_KEY, ENGINE_MODEL
(the alias the server answers as), LINES, MAX_TOKENS."""

import io
import json
import os
import time

from openai import OpenAI

client = OpenAI(
    base_url=os.environ["NIGHTSHIFT_URL"] + "/v1",
    api_key=os.environ["NIGHTSHIFT_API_KEY"],
    default_headers={"x-api-key": os.environ["NIGHTSHIFT_API_KEY"], "x-project-id": os.environ["NIGHTSHIFT_PROJECT_ID"]},
)
model = os.environ["ENGINE_MODEL"]
lines, max_tokens = int(os.environ["LINES"]), int(os.environ["MAX_TOKENS"])

requests = [
    {
        "custom_id": f"q{n}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": f"Question number {n}: " + "why? " * (n % 7)}],
            "max_tokens": max_tokens,
            "seed": n,
        },
    }
    for n in range(lines)
]
data = "".join(json.dumps(r) + "\n" for r in requests).encode()
file = client.files.create(file=("engine.jsonl", io.BytesIO(data)), purpose="batch")
batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
deadline = time.time() + 240
while batch.status not in ("completed", "failed", "expired", "cancelled"):
    assert time.time() < deadline, f"batch still {batch.status} after 240 s: {batch.request_counts}"
    time.sleep(0.5)
    batch = client.batches.retrieve(batch.id)
assert batch.status == "completed", batch
assert (batch.request_counts.completed, batch.request_counts.failed) == (lines, 0), batch.request_counts
assert batch.error_file_id is None, batch.error_file_id

records = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
assert sorted(r["custom_id"] for r in records) == sorted(r["custom_id"] for r in requests), "each line once"
prompt = completion = 0
for record in records:
    response = record["response"]
    assert response["status_code"] == 200, record
    body = response["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant", body
    usage = body["usage"]
    assert usage["completion_tokens"] == max_tokens, f"the test model answers max_tokens exactly: {usage}"
    prompt += usage["prompt_tokens"]
    completion += usage["completion_tokens"]
usage = batch.usage
assert (usage.input_tokens, usage.output_tokens) == (prompt, completion), (usage, prompt, completion)
assert usage.total_tokens == prompt + completion, usage
print(f"{lines} lines, {prompt} prompt and {completion} completion tokens, as the engine counted them")
print("engine SDK checks passed")
