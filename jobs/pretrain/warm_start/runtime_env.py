"""The training workers' runtime env for warm starts (launcher.py as their Python), on the driver."""
from __future__ import annotations

import logging
import shlex
import sys
from typing import Any

log = logging.getLogger(__name__)

LAUNCHER_MODULE = "bertpipe.jobs.pretrain.warm_start.launcher"
# Runtime env fields that choose the workers' Python themselves: a warm process would not be that Python.
OWN_PYTHON = ("py_executable", "pip", "uv", "conda", "container", "image_uri")


def launcher_command() -> str:
    """This interpreter running the launcher: every node of the project's clusters has the driver's Python at the
    same path (one image, or one machine)."""
    return f"{shlex.quote(sys.executable)} -m {LAUNCHER_MODULE}"


def worker_runtime_env(enabled: bool, job_runtime_env: dict[str, Any]) -> dict[str, Any]:
    """{} (Ray's own start) when off or when the job's runtime env picks the workers' Python; else py_executable."""
    if not enabled:
        return {}
    own = [field for field in OWN_PYTHON if job_runtime_env.get(field)]
    if own:
        log.warning("pretrain: warm worker starts are off: the job's runtime env sets %s", ", ".join(own))
        return {}
    return {"py_executable": launcher_command()}
