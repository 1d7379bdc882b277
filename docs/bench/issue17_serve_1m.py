"""Issue 17: `tessera serve --world W` over HTTP with one long prompt — prefill time, decode ms/token and
every rank's peak memory, as a user of the server sees them.

Starts `python -m tessera.server.cli serve --model DIR --world W ...` (rank 0 starts the other ranks: NCCL on
CUDA, the ring backend on the CPU; TESSERA_PARALLEL_TRANSPORT is passed through), waits for /ready,
sends ONE streamed /v1/completions request whose prompt is --prompt-tokens random token ids
(ignore_eos, greedy, --max-tokens tokens), then reads /metrics (`tessera_memory_bytes`: rank 0's kinds and
`rank<R>_*` for the others) and stops the server with SIGTERM. Only the Python standard library on
the client side.

- prefill_s: from sending the request to the first streamed token (the first token is sampled from the
  last prefill chunk's logits, so this is the prefill plus one head and sampling, plus the upload);
- decode_ms_per_token: (last token's arrival - first token's) / (completion tokens - 1);
- memory: every `tessera_memory_bytes` kind after the request (each rank's MLX peak over its life).

Made for the two-H200 run (docs/PARALLEL.md, "V4 Flash at 1M tokens on two GPUs"); tested on the CPU
with --world 2 on a tiny random-weights model (tests/test_issue17_scripts.py). JSON lines to OUT,
progress to stdout (flushed); the server's log goes to OUT with `.serve.log` appended.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    args = _parse()
    out = open(args.out, "a")

    def emit(record: dict) -> None:
        out.write(json.dumps(record) + "\n")
        out.flush()
        print(json.dumps(record)[:400], flush=True)

    port = args.port or _free_port()
    log_path = Path(str(args.out) + ".serve.log")
    cmd = [sys.executable, "-m", "tessera.server.cli", "serve", "--model", str(args.model), "--world", str(args.world),
           "--port", str(port), "--prefill-chunk", str(args.chunk), "--indexer-tile", str(args.tile),
           "--max-context", str(args.prompt_tokens + args.max_tokens), *args.serve_arg]
    emit(dict(event="start", command=cmd, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
              transport_env=os.environ.get("TESSERA_PARALLEL_TRANSPORT")))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log_path, "wb") as log:
        server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    status = 1
    try:
        start = time.monotonic()
        _wait_ready(server, port, args.ready_timeout_s, log_path)
        emit(dict(event="ready", seconds=time.monotonic() - start))
        emit(_request(port, args))
        emit(dict(event="memory", bytes=_memory(port)))
        status = 0
    finally:
        emit(_stop(server))
        if status:
            print(log_path.read_text()[-4000:], flush=True)
    return status


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="JSON lines are appended here")
    p.add_argument("--model", type=Path, required=True, help="a model directory (e.g. make-model --in-memory)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=1_048_576)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-timeout-s", type=float, default=600)
    p.add_argument("--request-timeout-s", type=float, default=3600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[], help="one more argument for `serve` (repeatable)")
    return p.parse_args()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, timeout: float = 5) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _wait_ready(server: subprocess.Popen, port: int, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    last_print = 0.0
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} before it was ready:\n"
                               + log_path.read_text()[-4000:])
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server was not ready within {timeout_s} s")
        try:
            if _get(port, "/ready", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() - last_print > 15:
            last_print = time.monotonic()
            lines = log_path.read_text(errors="replace").strip().splitlines()
            print(f"waiting for /ready; server log: {lines[-1][-200:] if lines else ''}", flush=True)
        time.sleep(0.5)


def _request(port: int, args) -> dict:
    vocab = int(json.loads((args.model / "config.json").read_text())["vocab_size"])
    rng = random.Random(args.seed)
    prompt = [rng.randrange(2, vocab) for _ in range(args.prompt_tokens)]  # 0/1 are BOS/EOS
    body = json.dumps({"model": Path(args.model).name, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=args.request_timeout_s)
    sent = time.monotonic()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"/v1/completions answered {response.status}: {response.read()[:2000]!r}")
    arrivals, usage = [], None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        if chunk.get("usage"):
            usage = chunk["usage"]
        if any(c.get("text") for c in chunk.get("choices", [])):
            arrivals.append(time.monotonic())
            if len(arrivals) == 1:
                print(f"first token after {arrivals[0] - sent:.2f} s", flush=True)
    conn.close()
    if not arrivals or usage is None:
        raise RuntimeError(f"the stream ended without tokens or usage (tokens seen: {len(arrivals)}, usage: {usage})")
    generated = usage["completion_tokens"]
    gaps = [(b - a) * 1000 for a, b in zip(arrivals, arrivals[1:])]
    return dict(event="request", prompt_tokens=usage["prompt_tokens"], completion_tokens=generated,
                body_bytes=len(body), prefill_s=arrivals[0] - sent,
                decode_ms_per_token=(arrivals[-1] - arrivals[0]) * 1000 / max(generated - 1, 1),
                chunk_gap_ms_median=statistics.median(gaps) if gaps else None, total_s=arrivals[-1] - sent)


_MEMORY = re.compile(r'^tessera_memory_bytes\{[^}]*kind="([^"]+)"[^}]*\}\s+(\S+)$')


def _memory(port: int) -> dict[str, int]:
    status, text = _get(port, "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    out = {}
    for line in text.decode().splitlines():
        m = _MEMORY.match(line)
        if m:
            out[m.group(1)] = int(float(m.group(2)))
    return out


def _stop(server: subprocess.Popen) -> dict:
    start = time.monotonic()
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)
    return dict(event="stopped", exit_code=server.returncode, seconds=time.monotonic() - start)


if __name__ == "__main__":
    sys.exit(main())
