"""Which code a run used: the git commit of the checkout and whether it had uncommitted changes."""
from __future__ import annotations

import subprocess
from pathlib import Path

COMMIT_TAG = "bertpipe.git_commit"
DIRTY_TAG = "bertpipe.git_dirty"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).resolve().parent,
                             timeout=5)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def git_tags() -> dict[str, str]:
    """The code a run used, as MLflow tags: commit and whether the tree had uncommitted changes ("unknown" outside
    git)."""
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {COMMIT_TAG: commit or "unknown", DIRTY_TAG: "unknown" if dirty is None else str(bool(dirty)).lower()}


def is_dirty(tags: dict[str, str]) -> bool:
    return tags.get(DIRTY_TAG) == "true"


def code_version(tags: dict[str, str]) -> str:
    """The code version manifests and model cards record: the commit, marked -dirty when the tree had uncommitted
    changes."""
    return tags.get(COMMIT_TAG, "unknown") + ("-dirty" if is_dirty(tags) else "")
