"""Issue 12's confirmation run on the H200 (docs/BENCHMARKS.md, "Issue 12"), the parts that need the
code before the fix (emulated: one attention call per tile, `attention_blocks` replaced):
`old-check-gpu`: `check gpu` on two matrix rows with the old attention (must exit 1);
`decode`: decode vs fresh prefill at ctx 20011, chunk 3001, tile 701 on the 4-layer flash-attn model,
before and after. Usage: python3 -u docs/bench/issue12_confirm.py old-check-gpu|decode MODEL_DIR"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tessera.engine.model import attention
from tessera.engine.model.loader import load_model
from tessera.engine.tools import commands
from tessera.engine.tools.consistency import check_model_consistency

PER_TILE = lambda r0, r1, length, block=0: [(r0, r1, r0, r1)]  # noqa: E731


def main(step: str, model_dir: str) -> int:
    if step == "old-check-gpu":
        attention.attention_blocks = PER_TILE
        return commands.main(["check", "gpu", "--model", model_dir, "--shape", "5011:3001:701",
                              "--shape", "5011:3001:1000", "--rows", "1001"])
    model = load_model(Path(model_dir), dtype="bfloat16", progress=False)
    fixed = attention.attention_blocks
    for chunk, tile in ((3001, 701), (3001, 3001), (3072, 701), (4096, 1024)):
        for name, blocks in (("before", PER_TILE), ("after", fixed)):
            if name == "before" and tile == chunk:
                continue
            attention.attention_blocks = blocks
            report = check_model_consistency(model, 20011, 2, chunk, tile)
            print(json.dumps({"code": name, **report.as_dict()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
