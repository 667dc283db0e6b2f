"""`betelgeuse chat` as a user runs it: a real cluster with the HTTP API, the CLI in its own process reading
turns from stdin. Each answer equals what the official `openai` client gets for the same conversation (the CLI
resends the whole conversation every turn)."""

from __future__ import annotations

import subprocess
import sys

import pytest

try:
    from tests import service_helpers as h
except ImportError:  # tests/ itself is on sys.path
    import service_helpers as h
service_model = h.service_model
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def cluster(service_model, tmp_path_factory):
    c = h.start_cluster(service_model, tmp_path_factory.mktemp("chat"), http="auto")
    yield c
    c.stop()


def _chat(cluster, stdin: str, *args) -> subprocess.CompletedProcess:
    from services.launcher import python_env
    return subprocess.run([sys.executable, "-m", "betelgeuse.cli", "chat", "--url", cluster.http_url, *args],
                          input=stdin, capture_output=True, text=True, timeout=120, env=python_env())


def test_chat_resends_the_conversation(cluster):
    r = _chat(cluster, "Hello there\nAnd again\n/exit\n", "--temperature", "0", "--max-tokens", "8",
              "--system", "Be brief.")
    assert r.returncode == 0, r.stderr
    client = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    first = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And again"}]
    second = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    assert r.stdout == first.choices[0].message.content + "\n" + second.choices[0].message.content + "\n"


def test_chat_errors_are_one_line(cluster, tmp_path):
    r = _chat(cluster, "Hi\n", "--temperature", "9")
    assert r.returncode == 0 and "betelgeuse: error: HTTP 400: temperature" in r.stderr and "Traceback" not in r.stderr
    from services.launcher import free_port
    r = subprocess.run([sys.executable, "-m", "betelgeuse.cli", "chat", "--url", f"http://127.0.0.1:{free_port()}"],
                       input="Hi\n", capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("betelgeuse: error: cannot reach the API")
