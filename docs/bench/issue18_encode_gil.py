"""Issue 18: how long each tokenizers entry point holds the GIL on a 10 MB prompt (what stalls the event loop).

A ticker thread sleeps 5 ms at a time and records its longest gap: a call that holds the GIL shows up as a gap
as long as the call. Run from the repo root:
    PYTHONPATH=$PWD python docs/bench/issue18_encode_gil.py
Prints one JSON object.
"""

import json
import tempfile
import threading
import time
from pathlib import Path

import tokenizers

from tessera.engine.model.tokenizer import Tokenizer
from tessera.engine.tools.tokenizer_train import train_tokenizer

backend = Tokenizer.from_dir(train_tokenizer(Path(tempfile.mkdtemp()) / "tok", vocab_size=2048, seed=0))._backend
text = ("hello world, this is a prompt with some words. " * 220000)[:10_000_000]
calls = {
    "encode": lambda: backend.encode(text, add_special_tokens=False).ids,
    "encode_batch": lambda: backend.encode_batch([text], add_special_tokens=False)[0].ids,
    "encode_batch_fast": lambda: backend.encode_batch_fast([text], add_special_tokens=False)[0].ids,
}
results = {"tokenizers": tokenizers.__version__, "prompt_chars": len(text)}
for name, call in calls.items():
    stop, gaps = threading.Event(), [0.0]

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.perf_counter()
    ids = call()
    seconds = time.perf_counter() - started
    stop.set()
    ticker.join()
    results[name] = {"tokens": len(ids), "seconds": round(seconds, 3), "max_gap_ms": round(max(gaps) * 1000, 1)}
print(json.dumps(results))
