"""Importing this checkout without installing it (standard library only).

Installed, the checkout's folders `engine/`, `server/`, `kernels/` (and the data in `config/`) are the packages
`tessera.engine`, `tessera.server`, `tessera.kernels` (pyproject.toml maps them; `tessera` is an implicit namespace
package). Without an install, a folder named `tessera` that holds links to those folders, put on the path, gives the
same import names. README.md ("From a source checkout, without installing") has the same recipe as a shell
one-liner; tests/conftest.py calls `use_source_tree()` so that `PYTHONPATH=$PWD python -m pytest` keeps working.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "tessera"
LINKED = ("engine", "server", "kernels", "config")  # the folders pyproject.toml installs under tessera/


def imports_this_checkout(root: Path = ROOT) -> bool:
    """Whether `import tessera.engine` in this process loads `root`'s engine/ (an editable install, a link tree)."""
    try:
        spec = importlib.util.find_spec(f"{NAMESPACE}.engine")
    except ModuleNotFoundError:  # no `tessera` at all
        return False
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().is_relative_to(root)


def source_tree(root: Path = ROOT, parent: Path | None = None) -> Path:
    """Make (or re-point) `<parent>/tessera/<folder>` links to `root`'s folders and return `parent`: the entry to put
    on sys.path / PYTHONPATH. The default parent is a temp folder per checkout. Safe to run concurrently: each link
    is made under a private name and renamed into place."""
    if parent is None:
        digest = hashlib.sha1(str(root).encode()).hexdigest()[:12]
        parent = Path(tempfile.gettempdir()) / f"tessera-source-{digest}"
    package = parent / NAMESPACE
    package.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        link, target = package / name, root / name
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        staged = package / f".{name}.{os.getpid()}"
        staged.unlink(missing_ok=True)
        staged.symlink_to(target, target_is_directory=True)
        os.replace(staged, link)
    return parent


def use_source_tree(root: Path = ROOT) -> Path | None:
    """Unless `tessera.*` already imports `root` (an editable install of it), put a link tree of `root` first on this
    process's sys.path and on PYTHONPATH, which the subprocesses tests start (`python -m tessera...`, the server, the
    ranks of `check parallel`) inherit. Returns the entry added, or None."""
    if imports_this_checkout(root):
        return None
    entry = source_tree(root)
    sys.path.insert(0, str(entry))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(entry), os.environ.get("PYTHONPATH")) if p)
    sys.modules.pop(NAMESPACE, None)  # a `tessera` namespace found elsewhere (another checkout's install)
    importlib.invalidate_caches()
    if not imports_this_checkout(root):
        raise RuntimeError(f"{entry} is first on sys.path but `{NAMESPACE}.engine` does not load {root}/engine")
    return entry


if __name__ == "__main__":  # `python3 tests/support/source_tree.py` prints the entry for PYTHONPATH
    print(source_tree())
