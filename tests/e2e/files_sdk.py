"""The Files API as the official OpenAI Python SDK sees it (run by tests/serve/sdk_e2e.rs)."""

import os

import openai
from openai import OpenAI

base_url = os.environ["NIGHTSHIFT_URL"] + "/v1"
project_id = os.environ["NIGHTSHIFT_PROJECT_ID"]
api_key = os.environ["NIGHTSHIFT_API_KEY"]
client = OpenAI(
    base_url=base_url,
    api_key=api_key,
    default_headers={"x-api-key": api_key, "x-project-id": project_id},
    max_retries=0,
)

created = [
    client.files.create(file=(f"part-{n}.jsonl", f'{{"n": {n}}}\n'.encode()), purpose="batch") for n in range(5)
]
assert all(f.object == "file" and f.purpose == "batch" and f.status == "processed" for f in created)

# Auto-pagination follows `after` cursors across pages of two.
page = client.files.list(limit=2)
assert len(page.data) == 2 and page.has_more
seen = [f.id for f in client.files.list(limit=2)]
assert seen == [f.id for f in reversed(created)], seen
ascending = [f.id for f in client.files.list(limit=2, order="asc")]
assert ascending == [f.id for f in created], ascending

assert client.files.content(created[3].id).text == '{"n": 3}\n'

# Errors surface as the SDK's typed exceptions, with our codes.
try:
    client.files.retrieve("file-does-not-exist")
    raise AssertionError("expected a 404")
except openai.NotFoundError as error:
    assert error.code == "file_not_found", error.body

try:
    client.files.create(file=("a.jsonl", b"x\n"), purpose="fine-tune")
    raise AssertionError("expected a 400")
except openai.BadRequestError as error:
    assert error.code == "invalid_purpose" and error.param == "purpose", error.body

try:
    client.files.create(file=("a.jsonl", b""), purpose="batch")
    raise AssertionError("expected a 400")
except openai.BadRequestError as error:
    assert error.code == "empty_file", error.body

try:
    client.files.list(limit=0)
    raise AssertionError("expected a 400")
except openai.BadRequestError as error:
    assert error.code == "invalid_limit", error.body

wrong_key = OpenAI(base_url=base_url, api_key="x", default_headers={"x-api-key": "wrong", "x-project-id": project_id}, max_retries=0)
try:
    wrong_key.files.list()
    raise AssertionError("expected a 403")
except openai.PermissionDeniedError as error:
    assert error.status_code == 403

no_project = OpenAI(base_url=base_url, api_key="x", default_headers={"x-api-key": api_key}, max_retries=0)
try:
    no_project.files.list()
    raise AssertionError("expected a 401")
except openai.AuthenticationError as error:
    assert error.status_code == 401

for f in created:
    assert client.files.delete(f.id).deleted
assert [f.id for f in client.files.list()] == []
print("files SDK checks passed")
