"""A user's batch on Kubernetes: the official OpenAI SDK against `nightshift api`
(run by tests/cluster/operator.rs). Prints one JSON summary line for the test to check."""

import json
import os
import sys
import time

from openai import OpenAI

api_key = os.environ["NIGHTSHIFT_API_KEY"]
client = OpenAI(
    base_url=os.environ["NIGHTSHIFT_URL"] + "/v1",
    api_key=api_key,
    default_headers={"x-api-key": api_key, "x-project-id": os.environ["NIGHTSHIFT_PROJECT_ID"]},
    max_retries=0,
)
lines = int(os.environ.get("LINES", "20"))
model = os.environ.get("MODEL", "mock-a")
body = {"model": model}
if os.environ.get("MAX_TOKENS"):
    body["max_tokens"] = int(os.environ["MAX_TOKENS"])
payload = "".join(
    json.dumps({"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions",
                "body": {**body, "messages": [{"role": "user", "content": f"line-{n}"}]}}) + "\n"
    for n in range(lines)
).encode()
uploaded = client.files.create(file=("input.jsonl", payload), purpose="batch")
batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
print(json.dumps({"event": "created", "id": batch.id, "status": batch.status}), flush=True)
if os.environ.get("CREATE_ONLY"):
    sys.exit(0)

# CANCEL_AFTER=n: cancels the batch once n of its lines have completed.
cancel_after = int(os.environ["CANCEL_AFTER"]) if os.environ.get("CANCEL_AFTER") else None
deadline = time.time() + float(os.environ.get("TIMEOUT", "120"))
while batch.status not in ("completed", "failed", "expired", "cancelled"):
    assert time.time() < deadline, f"batch still {batch.status}: {batch}"
    time.sleep(0.2)
    batch = client.batches.retrieve(batch.id)
    if cancel_after is not None and batch.request_counts.completed >= cancel_after:
        batch = client.batches.cancel(batch.id)
        print(json.dumps({"event": "cancelling", "status": batch.status}), flush=True)
        cancel_after = None

output = client.files.content(batch.output_file_id).text if batch.output_file_id else ""
errors = client.files.content(batch.error_file_id).text if batch.error_file_id else ""
print(json.dumps({
    "event": "finished",
    "id": batch.id,
    "status": batch.status,
    "created_at": batch.created_at,
    "cancelling_at": batch.cancelling_at,
    "cancelled_at": batch.cancelled_at,
    "counts": batch.request_counts.model_dump(),
    "output": [json.loads(line) for line in output.splitlines()],
    "errors": [json.loads(line) for line in errors.splitlines()],
}), flush=True)
