"""How close the pre-training ETA comes to the time the stage really had left, on a real run of this machine.

    python benchmarks/bench_eta.py [--config tiny] [--workdir DIR] [--set KEY=VALUE ...] [--from-step 10]

Runs the workflow's data stages (skipped where fresh; they need the sample `make run` fetches), then the pretrain
stage again (`--only pretrain --force`), reading the console as it comes. Every ETA the progress line reported (each
one is in the run's log file with its time) is set against the seconds the stage had left until its `pretrain done`
line. The ETA prices only what the run measured (jobs/pretrain/metrics/eta.py): what follows the workers' last
checkpoint (Ray Train stopping them, the curves, the registration) is in the truth and not in the estimate. Prints
one row per report from `--from-step` on, and the median and worst error. The arithmetic itself is tested with a fake
clock (tests/test_eta.py); how good its measurements are depends on the machine, which is this script's job.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

PROGRESS = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO bertpipe\.progress: pretrain: (\d+)/(\d+) .*"
                      r"ETA (\d+):(\d\d):(\d\d)")


def bertpipe(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "bertpipe"), *args]


def timed_run(command: list[str]) -> list[tuple[float, str]]:
    """The command's console lines, each with the wall time it arrived; raises if the command fails."""
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))
            print(line, end="", flush=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}")
    return lines


def reports(log_file: Path, from_step: int) -> list[tuple[int, float, float]]:
    """(step, ETA seconds, wall time of the report) of every ETA the log holds from `from_step` on."""
    out = []
    for line in log_file.read_text().splitlines():
        m = PROGRESS.match(line)
        if m and int(m.group(2)) >= from_step:
            h, mm, s = (int(x) for x in m.group(4, 5, 6))
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((int(m.group(2)), 3600 * h + 60 * mm + s, at))
    return out


def table(found: list[tuple[int, float, float]], done_at: float) -> list[float]:
    """Prints the rows; returns each report's error as a fraction of the truth (the ETA is shown in whole seconds,
    cut down: an estimate of 3 means [3, 4) s, so the distance is from that second; negative: too short)."""
    print(f"\n{'step':>5} {'ETA s':>6} {'left s':>7} {'error':>7}")
    errors = []
    for step, shown, at in found:
        truth = done_at - at
        error = shown - truth if shown > truth else min(shown + 1 - truth, 0.0)
        errors.append(abs(error) / max(truth, 1e-9))
        print(f"{step:5d} {shown:6.0f} {truth:7.1f} {100 * error / max(truth, 1e-9):+6.0f}%")
    return errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--workdir", default=None, help="default: a new temporary folder")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--from-step", type=int, default=10)
    args = ap.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_eta_")
    common = ["--config", args.config, "--workdir", workdir, *(x for o in args.overrides for x in ("--set", o))]
    timed_run(bertpipe("run", *common, "--only", "clean,vocab,pairs"))
    lines = timed_run(bertpipe("run", *common, "--only", "pretrain", "--force"))
    done_at = next(at for at, line in lines if line.startswith("  pretrain done: "))
    log_file = Path(next(line for _, line in lines if line.startswith("  log ")).split()[1])
    found = reports(log_file, args.from_step)
    if not found:
        raise SystemExit(f"no ETA reported from step {args.from_step} on in {log_file}")
    errors = table(found, done_at)
    print(f"\n{len(errors)} reports from step {args.from_step}: median error {100 * statistics.median(errors):.0f}%, "
          f"worst {100 * max(errors):.0f}% (workdir {workdir})")


if __name__ == "__main__":
    main()
