"""A follower rank of `tessera serve --world N` (started by rank 0, engine/parallel/serving.py, or by
`mlx.launch`, then through `tessera serve` itself): join the world, load this rank's layers, follow rank 0's
steps until it says stop. Imports only MLX, numpy and the
engine, so it runs where the web server's packages are not installed."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path

from tessera.engine.parallel.launch import init_group, launched_world
from tessera.engine.parallel.serving import join_launched_world, load_stage, run_follower

logger = logging.getLogger("tessera.parallel")


def _exit_when_orphaned(poll_s: float = 0.5) -> None:
    """Rank 0 started us: if it is gone (even before the world formed), so are we."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logger.critical("rank 0 (pid %d) is gone; exiting", parent)
        os._exit(1)

    threading.Thread(target=watch, name="tessera-parent-watch", daemon=True).start()


def follow(model_dir: Path, indexer_tile: int, backend: str, world: int | None = None) -> int:
    """Join the world, load this rank's layers and follow rank 0 until it says stop (0) or is lost (1)."""
    group = init_group(backend) if world is None else join_launched_world(world, backend)
    stage = load_stage(model_dir, group, backend)
    try:
        return run_follower(stage, indexer_tile)
    except RuntimeError as exc:  # MLX's transport: a peer was lost
        logger.critical("lost the pipeline: %s; exiting", exc)
        return 1


def follow_if_launched_follower(model_dir: Path | None, indexer_tile: int, world: int) -> int | None:
    """Under a launcher (`mlx.launch … tessera serve --world N`), on a rank other than 0: follow and return the
    exit status. Otherwise None: this process is rank 0 (or the world is not made yet) and serves HTTP."""
    launched = launched_world()
    if launched is None or launched[0] == 0:
        return None
    from tessera.engine.tools.default_model import ensure_default_model

    return follow(Path(model_dir) if model_dir is not None else ensure_default_model(), indexer_tile, launched[1], world)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tessera.engine.parallel.follower")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--tile", type=int, required=True, help="indexer tile, as rank 0's")
    p.add_argument("--backend", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s[rank " + os.environ.get("MLX_RANK", "?") + "]: %(message)s")
    _exit_when_orphaned()
    return follow(args.model, args.tile, args.backend)


if __name__ == "__main__":
    sys.exit(main())
