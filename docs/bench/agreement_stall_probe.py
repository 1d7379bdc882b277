"""Which official-format agreement prompt stalls on a GPU, and with which switches: one process per (switch
setting, prompt), 25 s each, until BUDGET seconds are spent (docs/BENCHMARKS.md "Session 10 on the H200").

  python docs/bench/agreement_stall_probe.py [BUDGET]
"""
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()  # `tessera.*` = this checkout, unless it already is

from tessera.engine.tools.device_agreement import make_agreement_model  # noqa: E402

with mx.stream(mx.cpu):
    d = make_agreement_model(Path("/tmp/agree-official"), "official")
OFF = {k: "0" for k in ("TESSERA_SINKHORN_KERNEL", "TESSERA_ROW_GATHER_KERNEL", "TESSERA_MOE_INDEX_KERNEL",
                        "TESSERA_MOE_COMBINE_KERNEL", "TESSERA_DECODE_BATCH_KERNELS", "TESSERA_COMPILE")}
CONFIGS = [("default", {}, (5, 31, 62)), ("kernels+compile off", OFF, (5, 31, 62)), ("compile off", {"TESSERA_COMPILE": "0"}, (5, 62)),
           ("moe kernels off", {"TESSERA_MOE_INDEX_KERNEL": "0", "TESSERA_MOE_COMBINE_KERNEL": "0", "TESSERA_ROW_GATHER_KERNEL": "0"}, (5, 62))]
code = ("import sys, mlx.core as mx; from tessera.engine.tools.device_agreement import check_device_agreement; "
        "rows = check_device_agreement(sys.argv[1], device=mx.gpu, lengths=(int(sys.argv[2]),)); "
        "print('worst', max(r.rel_diff for r in rows), [round(r.rel_diff, 5) for r in rows], flush=True)")
budget = float(sys.argv[1]) if len(sys.argv) > 1 else 200
start = time.time()
for name, env, lengths in CONFIGS:
    for n in lengths:
        if time.time() - start > budget:
            print("budget spent", flush=True); sys.exit(0)
        t = time.time()
        try:
            out = subprocess.run([sys.executable, "-c", code, str(d), str(n)], env={**os.environ, **env},
                                 capture_output=True, text=True, timeout=25)
            res = (out.stdout.strip().splitlines() or ["rc=%d %s" % (out.returncode, out.stderr[-300:])])[-1]
        except subprocess.TimeoutExpired:
            res = "HUNG (>25 s)"
        print(f"{name:22s} prompt {n:3d}: {res}  [{time.time() - t:.1f} s]", flush=True)
