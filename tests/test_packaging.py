"""What `pip install tessera` puts on disk: one top-level package, `tessera`, holding the checkout's engine/,
server/ and kernels/ (and the default config the server reads), so it coexists with any other distribution that
ships a generic top-level `server` or `engine`. Also the uninstalled recipe README.md documents."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.source_tree import source_tree

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "tessera"
FOLDERS = ("engine", "server", "kernels")  # the checkout's packages, installed as tessera.<folder>
DATA = ("config/default.toml",)  # files the code reads next to its packages (server/settings.py)
GENERIC = ("server", "engine")  # top-level names another distribution may well ship
BUILD = [sys.executable, "-c", "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"]


def source_packages() -> set[str]:
    """Installed names of every folder under engine/, server/, kernels/ that holds Python files."""
    return {".".join((NAMESPACE, *path.parent.relative_to(ROOT).parts))
            for folder in FOLDERS for path in (ROOT / folder).rglob("*.py") if "__pycache__" not in path.parts}


def build_wheel(project: Path, out: Path) -> Path:
    """setuptools' own PEP 517 hook, in a child process, on a copy (a `build/` left by an earlier build in the
    checkout could otherwise carry files the current pyproject.toml no longer installs)."""
    done = subprocess.run([*BUILD, str(out)], cwd=project, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return out / done.stdout.strip().splitlines()[-1]


def copy_project(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for entry in ROOT.iterdir():
        if entry.is_file() and not entry.name.startswith("."):
            shutil.copy2(entry, dest / entry.name)
    for folder in (*FOLDERS, "config"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)
    return dest


def generic_project(dest: Path) -> Path:
    """Another distribution whose top-level packages are `server` and `engine`, each saying whose it is."""
    (dest / "pyproject.toml").write_text('[project]\nname = "generic-names"\nversion = "1.0"\n'
                                         f"[tool.setuptools]\npackages = {list(GENERIC)!r}\n")
    for name in GENERIC:
        (dest / name).mkdir()
        (dest / name / "__init__.py").write_text(f"OWNER = 'generic-names {name}'\n")
    return dest


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("packaging")
    for name in ("tessera-src", "generic-src", "dist"):
        (tmp / name).mkdir()
    return (build_wheel(copy_project(tmp / "tessera-src"), tmp / "dist"),
            build_wheel(generic_project(tmp / "generic-src"), tmp / "dist"))


def test_pyproject_lists_every_package():
    """setuptools cannot prefix what it finds, so pyproject.toml lists the packages; a new folder must be added."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    missing = source_packages() - listed
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_the_wheel_holds_one_top_level_package_with_every_module(wheels):
    ours, _ = wheels
    names = set(zipfile.ZipFile(ours).namelist())
    tops = {name.split("/")[0] for name in names}
    assert tops == {NAMESPACE, "-".join(ours.name.split("-")[:2]) + ".dist-info"}  # tessera-0.1.0.dist-info
    wanted = {f"{NAMESPACE}/{path.relative_to(ROOT).as_posix()}"
              for folder in FOLDERS for path in (ROOT / folder).rglob("*.py") if "__pycache__" not in path.parts}
    wanted |= {f"{NAMESPACE}/{data}" for data in DATA}
    missing = wanted - names
    assert not missing, f"not in the wheel: {sorted(missing)}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(ours).read(entry_points).decode()
    assert re.search(r"^tessera = tessera\.server\.cli:main$", scripts, re.M), scripts


def test_tessera_installs_beside_a_distribution_with_generic_top_level_names(wheels, tmp_path: Path):
    """The collision the namespace prevents: both installed into one folder, each package is its own."""
    ours, theirs = wheels
    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                                "--target", str(target), str(theirs), str(ours)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-4000:]
    probe = "; ".join([
        "import json, sys",
        *(f"import {name}" for name in GENERIC),
        f"import {NAMESPACE}.server.cli as cli, {NAMESPACE}.server.settings as settings",
        f"import {NAMESPACE}.engine.serving.protocol, {NAMESPACE}.kernels.indexer",
        "print(json.dumps({"
        + ", ".join(f"'{name}': {name}.OWNER" for name in GENERIC)
        + f", 'files': [m.__file__ for n, m in sys.modules.items() if n.startswith('{NAMESPACE}.')]"
        + ", 'config': str(settings.DEFAULT_CONFIG_FILE), 'config_exists': settings.DEFAULT_CONFIG_FILE.is_file()"
        + ", 'main': callable(cli.main)}))",
    ])
    # From an empty folder, with -S (no .pth files: an editable install's import hook would answer for a module the
    # wheel lacks) and a path of the target, then this interpreter's library folders for the dependencies.
    libraries = [p for p in sys.path if p and Path(p).is_dir() and not (Path(p) / NAMESPACE).exists()
                 and Path(p).resolve() != ROOT]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(target), *libraries])}
    run = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(run.stdout.splitlines()[-1])
    assert {name: seen[name] for name in GENERIC} == {name: f"generic-names {name}" for name in GENERIC}
    outside = [f for f in seen["files"] if not Path(f).is_relative_to(target / NAMESPACE)]
    assert len(seen["files"]) > 10 and not outside, outside
    assert seen["config"] == str(target / NAMESPACE / "config" / "default.toml") and seen["config_exists"]
    assert seen["main"]


def test_the_readme_recipe_runs_a_checkout_without_installing(tmp_path: Path):
    """README.md's shell recipe (links in a folder named `tessera`) runs the engine's CLI from an empty folder."""
    readme = (ROOT / "README.md").read_text()
    recipe = re.search(r"```bash\n(mkdir -p /tmp/tessera-src.*?)```", readme, re.S)
    assert recipe, "README.md lost its source-checkout recipe"
    script = recipe[1].replace("/tmp/tessera-src", str(tmp_path / "src"))
    script = script.replace("/tmp/mlx-site:", "")  # the GPU machine's MLX; here it comes with this interpreter
    script += (f'\ncd "{tmp_path}" && "{sys.executable}" -m {NAMESPACE}.engine.tools.commands --help'
               f' && "{sys.executable}" -c "import {NAMESPACE}.server.cli as m; print(m.__file__)"\n')
    # No inherited PYTHONPATH (tests/conftest.py may have put a link tree there): only the recipe's may answer.
    # An editable install's import hook comes after PYTHONPATH's entries, and would show in the printed path.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "make-model" in run.stdout
    assert run.stdout.splitlines()[-1] == str(tmp_path / "src" / NAMESPACE / "server" / "cli.py")
    assert (tmp_path / "src" / NAMESPACE / "engine").resolve() == ROOT / "engine"


def test_the_python_source_tree_matches_the_installed_layout(tmp_path: Path):
    entry = source_tree(ROOT, tmp_path)
    for folder in (*FOLDERS, "config"):
        assert (entry / NAMESPACE / folder).resolve() == ROOT / folder
    assert source_tree(ROOT, tmp_path) == entry  # again: the links are kept (idempotent)
