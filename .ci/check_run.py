"""After `make run`: every stage is committed and fresh, the GLUE report exists, and `make run` again is all
skips in under a minute. Exits non-zero, saying why, otherwise."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ["clean", "vocab", "pairs", "pretrain", "glue"]


def fail(msg: str) -> None:
    print(f"check_run: FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


def main() -> None:
    status = subprocess.run([str(REPO / ".venv/bin/bertpipe"), "status", "--config", "configs/tiny.yaml", "--json"],
                            cwd=REPO, capture_output=True, text=True, check=True)
    states = {r["stage"]: r["state"] for r in json.loads(status.stdout)}
    if states != dict.fromkeys(STAGES, "fresh"):
        fail(f"stages not all fresh after make run: {states}")
    report = REPO / "work/tiny/glue/summary.md"
    if not report.is_file() or "GLUE score" not in report.read_text():
        fail(f"no GLUE report at {report}")
    started = time.time()
    again = subprocess.run(["make", "run"], cwd=REPO, capture_output=True, text=True)
    seconds = time.time() - started
    if again.returncode != 0:
        fail(f"second make run exited {again.returncode}: {again.stderr[-2000:]}")
    actions = {line.split()[0]: line.split()[1] for line in again.stdout.splitlines()
               if line.split()[:1] and line.split()[0] in STAGES and len(line.split()) > 1}
    if actions != dict.fromkeys(STAGES, "skipped"):
        fail(f"second make run did not only skip: {actions}")
    if seconds >= 60:
        fail(f"second make run took {seconds:.1f} s (limit 60 s)")
    print(f"check_run: ok: 5 stages fresh, GLUE report at {report.relative_to(REPO)}, "
          f"second make run all skips in {seconds:.1f} s")


if __name__ == "__main__":
    main()
