"""The Batches API as the official OpenAI Python SDK sees it (run by tests/serve/sdk_e2e.rs)."""

import json
import os
import time

import openai
from openai import OpenAI

project_id = os.environ["NIGHTSHIFT_PROJECT_ID"]
api_key = os.environ["NIGHTSHIFT_API_KEY"]
client = OpenAI(
    base_url=os.environ["NIGHTSHIFT_URL"] + "/v1",
    api_key=api_key,
    default_headers={"x-api-key": api_key, "x-project-id": project_id},
    max_retries=0,
)


def jsonl(ids, model="echo"):
    lines = [
        {"custom_id": i, "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": [{"role": "user", "content": f"say {i}"}]}}
        for i in ids
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


good = client.files.create(file=("good.jsonl", jsonl(["a", "b", "c"])), purpose="batch")
created = [
    client.batches.create(
        input_file_id=good.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": str(n)},
    )
    for n in range(5)
]
first = created[0]
assert first.object == "batch" and first.status == "in_progress", first
assert first.request_counts.total == 3 and first.request_counts.completed == 0
assert first.metadata == {"run": "0"}
assert first.expires_at == first.created_at + 86400
assert first.errors is None and first.output_file_id is None

retrieved = client.batches.retrieve(first.id)
assert retrieved.id == first.id and retrieved.input_file_id == good.id

# Auto-pagination across pages of two, newest first.
ids = [b.id for b in client.batches.list(limit=2)]
assert ids == [b.id for b in reversed(created)], ids
page = client.batches.list(limit=2)
assert page.has_more and len(page.data) == 2

# A failed validation is a 400 with the line, and a failed batch afterwards.
bad = client.files.create(file=("bad.jsonl", jsonl(["x", "y", "x"])), purpose="batch")
try:
    client.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h")
    raise AssertionError("expected a 400")
except openai.BadRequestError as error:
    assert error.body["message"] == 'Line 3 duplicates custom_id "x"', error.body
    assert error.body["line"] == 3, error.body
failed = client.batches.list(limit=1).data[0]
assert failed.status == "failed" and failed.failed_at is not None
assert failed.errors.data[0].line == 3
assert failed.errors.data[0].message == 'Line 3 duplicates custom_id "x"'

try:
    client.batches.retrieve("batch_does_not_exist")
    raise AssertionError("expected a 404")
except openai.NotFoundError:
    pass

# The echo batches run to completion.
for batch in created:
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.05)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == 3 and batch.output_file_id and batch.error_file_id is None
output = client.files.content(batch.output_file_id).text
assert sorted(json.loads(line)["custom_id"] for line in output.splitlines()) == ["a", "b", "c"]

# Cancel a slow batch: cancelling, idempotent, then cancelled; 409 once terminal.
slow = client.files.create(file=("slow.jsonl", jsonl([f"s{n}" for n in range(20)], model="mock-slow")), purpose="batch")
running = client.batches.create(input_file_id=slow.id, endpoint="/v1/chat/completions", completion_window="24h")
cancelling = client.batches.cancel(running.id)
assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None, cancelling
again = client.batches.cancel(running.id)
assert again.cancelling_at == cancelling.cancelling_at
while cancelling.status == "cancelling":
    time.sleep(0.05)
    cancelling = client.batches.retrieve(running.id)
assert cancelling.status == "cancelled" and cancelling.cancelled_at is not None, cancelling
counts = cancelling.request_counts
assert counts.completed + counts.failed == counts.total == 20, counts
errors = [json.loads(line) for line in client.files.content(cancelling.error_file_id).text.splitlines()]
assert errors and all(e["error"]["code"] == "batch_cancelled" and e["response"] is None for e in errors)
for terminal in (cancelling, failed):
    try:
        client.batches.cancel(terminal.id)
        raise AssertionError("expected a 409")
    except openai.ConflictError as error:
        assert error.code == "batch_not_cancellable"
print("batches SDK checks passed")
