"""A test's script in a Python of its own: a pytest worker's tests share its Ray, which a script that starts its own
must not replace."""
from __future__ import annotations

import os
import subprocess
import sys


def run_alone(script: str, cwd) -> subprocess.CompletedProcess:
    """`script` in a Python of its own, with no Ray or MLflow setting of this process's; asserts it exited 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=400,
                         cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    return out
