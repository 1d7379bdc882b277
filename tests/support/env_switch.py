"""What a module-level switch reads from its environment variable, in a fresh interpreter (the
variable is read at import, so the running test process cannot show it)."""

from __future__ import annotations

import os
import subprocess
import sys


def switch_in_fresh_process(env_var: str, value: str | None, module: str, function: str) -> str:
    """`module.function()` printed by a new Python with `env_var` set to `value` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != env_var}
    if value is not None:
        env[env_var] = value
    code = f"from {module} import {function}; print({function}())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()
