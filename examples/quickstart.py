"""Nightshift quickstart: the official OpenAI Python SDK against `nightshift serve`.

    pip install openai
    nightshift serve                      # in another terminal
    python examples/quickstart.py

Credentials come from NIGHTSHIFT_PROJECT_ID / NIGHTSHIFT_API_KEY, or else from the
dev project that `nightshift serve` made under its data directory
(NIGHTSHIFT_DATA_DIR, default ./nightshift-data).
"""

import json
import os
import pathlib
import time

from openai import OpenAI


def credentials():
    project = os.environ.get("NIGHTSHIFT_PROJECT_ID")
    key = os.environ.get("NIGHTSHIFT_API_KEY")
    if project and key:
        return project, key
    data_dir = pathlib.Path(os.environ.get("NIGHTSHIFT_DATA_DIR", "nightshift-data"))
    stored = json.loads((data_dir / "dev" / "credentials.json").read_text())
    return stored["project_id"], stored["api_key"]


project_id, api_key = credentials()
client = OpenAI(
    base_url=os.environ.get("NIGHTSHIFT_URL", "http://127.0.0.1:8080") + "/v1",
    api_key=api_key,
    default_headers={"x-api-key": api_key, "x-project-id": project_id},
)

# 1. Upload a JSONL file of chat-completion requests.
questions = ["What is the capital of France?", "What is the capital of Germany?", "What is 2 + 2?"]
lines = [
    {
        "custom_id": f"req-{n}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "echo", "messages": [{"role": "user", "content": question}]},
    }
    for n, question in enumerate(questions, start=1)
]
payload = "".join(json.dumps(line) + "\n" for line in lines).encode()
uploaded = client.files.create(file=("requests.jsonl", payload), purpose="batch")
print(f"uploaded {uploaded.id}: {uploaded.filename}, {uploaded.bytes} bytes, expires at {uploaded.expires_at}")

# 2. List, retrieve and download it.
listed = [file.id for file in client.files.list(purpose="batch")]
print(f"listed {len(listed)} batch file(s); ours is among them: {uploaded.id in listed}")
retrieved = client.files.retrieve(uploaded.id)
content = client.files.content(uploaded.id).read()
assert content == payload, "downloaded bytes differ from the upload"
print(f"retrieved {retrieved.id} ({retrieved.status}) and downloaded {len(content)} identical bytes")

# 3. Create a batch from it.
batch = client.batches.create(
    input_file_id=uploaded.id,
    endpoint="/v1/chat/completions",
    completion_window="24h",
    metadata={"example": "quickstart"},
)
print(f"created batch {batch.id}: status {batch.status}, {batch.request_counts.total} requests")

# 4. Wait for it, then read the results (the built-in echo model answers with the question).
while batch.status not in ("completed", "failed", "expired", "cancelled"):
    time.sleep(0.5)
    batch = client.batches.retrieve(batch.id)
counts = batch.request_counts
print(f"batch {batch.id} is {batch.status}: {counts.completed} completed, {counts.failed} failed of {counts.total}")
if batch.output_file_id:
    for line in client.files.content(batch.output_file_id).text.splitlines():
        record = json.loads(line)
        answer = record["response"]["body"]["choices"][0]["message"]["content"]
        print(f"  {record['custom_id']}: {answer}")
if batch.error_file_id:
    for line in client.files.content(batch.error_file_id).text.splitlines():
        record = json.loads(line)
        print(f"  FAILED {record['custom_id']}: [{record['error']['code']}] {record['error']['message']}")

# 5. A scratch file, uploaded and deleted.
scratch = client.files.create(file=("scratch.jsonl", payload), purpose="batch")
deleted = client.files.delete(scratch.id)
print(f"deleted {deleted.id}: {deleted.deleted}")
