"""README's first command, `make serve`, answers a chat request on the embedded default model.

CI runs in a fresh clone where `make test` has just built .venv, so `make serve` finds the install
target satisfied and starts the server; TESSERA_PORT picks the port."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_harness import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("make") is None or not (REPO_ROOT / ".venv" / ".installed").exists(),
                    reason="needs make and the .venv that `make test` builds")
def test_make_serve_answers_a_chat_request(tmp_path):
    port = free_port()
    env = {**os.environ, "TESSERA_PORT": str(port), "TESSERA_HOME": str(tmp_path)}
    process = subprocess.Popen(["make", "--no-print-directory", "serve"], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()[0]
            try:
                if httpx.get(base + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="tessera-default", max_tokens=5,
                                               messages=[{"role": "user", "content": "hello"}])
        assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens >= 1
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # make and the server it started
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
