"""The official OpenAI Python SDK configured only by its own environment variables,
OPENAI_BASE_URL and OPENAI_API_KEY: no extra headers; and the expiry options
(`expires_after`, `output_expires_after`) as the SDK sends them (run by tests/serve/sdk_e2e.rs)."""

import json
import os
import time

import openai
from openai import OpenAI

client = OpenAI(max_retries=0)  # Everything from the environment.


def finished(batch):
    """The batch once it is terminal (within a minute)."""
    deadline = time.time() + 60
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.time() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    return batch


project_id = os.environ["NIGHTSHIFT_PROJECT_ID"]

lines = "".join(
    f'{{"custom_id": "env-{n}", "method": "POST", "url": "/v1/chat/completions", '
    f'"body": {{"model": "echo", "messages": [{{"role": "user", "content": "hello {n}"}}]}}}}\n'
    for n in range(3)
)
uploaded = client.files.create(
    file=("env.jsonl", lines.encode()), purpose="batch", expires_after={"anchor": "created_at", "seconds": 86400}
)
assert uploaded.id in [f.id for f in client.files.list()]
assert uploaded.expires_at == uploaded.created_at + 86400, uploaded
batch = client.batches.create(
    input_file_id=uploaded.id,
    endpoint="/v1/chat/completions",
    completion_window="24h",
    output_expires_after={"anchor": "created_at", "seconds": 7200},
)
batch = finished(batch)
assert batch.status == "completed" and batch.request_counts.completed == 3, batch
output_file = client.files.retrieve(batch.output_file_id)
assert output_file.expires_at == output_file.created_at + 7200, output_file
output = client.files.content(batch.output_file_id).text
assert sorted(json.loads(line)["custom_id"] for line in output.splitlines()) == ["env-0", "env-1", "env-2"], output

# An embeddings batch (enabled by the test's config), answered by the echo model.
embedding_lines = "".join(
    f'{{"custom_id": "emb-{n}", "method": "POST", "url": "/v1/embeddings", '
    f'"body": {{"model": "echo", "input": "some words {n}"}}}}\n'
    for n in range(2)
)
embedding_input = client.files.create(file=("emb.jsonl", embedding_lines.encode()), purpose="batch")
embeddings = client.batches.create(
    input_file_id=embedding_input.id, endpoint="/v1/embeddings", completion_window="24h"
)
assert embeddings.endpoint == "/v1/embeddings" and embeddings.model == "echo", embeddings
embeddings = finished(embeddings)
assert embeddings.status == "completed" and embeddings.request_counts.completed == 2, embeddings
assert embeddings.usage.input_tokens == 6 and embeddings.usage.total_tokens == 6, embeddings.usage
for record in map(json.loads, client.files.content(embeddings.output_file_id).text.splitlines()):
    assert record["response"]["body"]["object"] == "list", record
    assert len(record["response"]["body"]["data"][0]["embedding"]) == 8, record

# OpenAI's validation of the expiry options, as the SDK's typed error.
try:
    client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 60},
    )
    raise AssertionError("expected a 400")
except openai.BadRequestError as error:
    assert error.code == "integer_below_min_value", error.body
    assert error.param == "output_expires_after.seconds", error.body

# The key's own project, named by OpenAI(project=...): fine. Another project: refused.
assert OpenAI(max_retries=0, project=project_id).files.retrieve(uploaded.id).id == uploaded.id
try:
    OpenAI(max_retries=0, project="0b7e8a52-4a1c-4d5e-9a53-6f0c7d8e9f10").files.list()
    raise AssertionError("expected a 403")
except openai.PermissionDeniedError as error:
    assert error.code == "invalid_api_key", error.body

# A wrong key is OpenAI's 401, the SDK's AuthenticationError.
try:
    OpenAI(max_retries=0, api_key="sk-wrong").files.list()
    raise AssertionError("expected a 401")
except openai.AuthenticationError as error:
    assert error.code == "invalid_api_key", error.body
    assert error.body["message"] == "Incorrect API key provided", error.body

print("environment-only SDK checks passed")
