"""Pre-training losses of this checkout beside a reference checkout (another commit), on the same shards, vocabulary
and seed: issue 35's "losses bit-identical before and after" a restructuring of the training code.

    python benchmarks/compare_losses.py --ref /path/to/checkout-of-b3b2f3d [--steps 40] [--keep DIR]

The data stages run once, here; each side then runs `bertpipe run --only pretrain` on those shards
(`pretrain.input`, `vocab.path`) in a process of its own, with this venv's interpreter and packages and its own
code: the reference through a package shim on PYTHONPATH (bertpipe.pipeline / .model / .jobs linked to its
folders), which Python finds ahead of this venv's editable install. Compares the runs' learning histories
(`pretrain/history.json`: every logged step's losses and accuracies, every held-out evaluation) entry by entry,
prints the steps side by side, and exits 1 unless every entry is equal to the last bit.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHOWN = ("loss", "mlm_loss", "mlm_accuracy", "nsp_accuracy")  # every entry is compared whole (evaluations too)
_CLI = "import sys; from bertpipe.jobs.cli import main; sys.exit(main(sys.argv[1:]))"


def shim(ref: Path, where: Path) -> dict[str, str]:
    """An environment whose `bertpipe.*` imports resolve to the reference checkout's folders."""
    package = where / "bertpipe"
    package.mkdir(parents=True)
    for name in ("pipeline", "model", "jobs"):
        (package / name).symlink_to(ref / name)
    return {**os.environ, "PYTHONPATH": str(where)}


def bertpipe(env: dict[str, str] | None, *args: str) -> None:
    done = subprocess.run([sys.executable, "-c", _CLI, *args], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-4000:]
        sys.exit(f"bertpipe {' '.join(args[:3])} failed ({done.returncode}):\n{tail}")


def history(workdir: Path) -> list[dict]:
    return json.loads((workdir / "pretrain" / "history.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", required=True, type=Path, help="a checkout of the reference commit")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary folder)")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="compare-losses-"))
    common = ["--set", "mlflow.tracking_uri=off", "--set", "ray.dashboard=false"]
    data = root / "data"
    bertpipe(None, "run", "--config", "configs/tiny.yaml", *common, "--only", "clean,vocab,pairs",
             "--set", f"workdir={data}")
    overrides = ["--set", f"pretrain.input={data / 'pairs'}", "--set", f"vocab.path={data / 'vocab' / 'vocab.txt'}",
                 "--set", f"pretrain.max_steps={args.steps}", "--set", "pretrain.log_every_steps=1"]
    # Each side with its own tiny.yaml: the sections' names may differ between commits, not their training settings.
    sides = {"this": (None, root / "this", REPO),
             "ref": (shim(args.ref.resolve(), root / "shim"), root / "ref", args.ref.resolve())}
    for env, workdir, tree in sides.values():
        bertpipe(env, "run", "--config", str(tree / "configs" / "tiny.yaml"), *common, "--only", "pretrain",
                 *overrides, "--set", f"workdir={workdir}")
    this, ref = history(sides["this"][1]), history(sides["ref"][1])
    print(f"| step | {' | '.join(f'{k} this | {k} ref' for k in SHOWN)} | equal |")
    print("|---|" + "---|" * (2 * len(SHOWN) + 1))
    unequal = 0
    for a, b in zip(this, ref):
        same = a == b
        unequal += not same
        cells = " | ".join(f"{a.get(k)!r} | {b.get(k)!r}" for k in SHOWN)
        print(f"| {a.get('step')} | {cells} | {'yes' if same else 'NO'} |")
    if len(this) != len(ref):
        print(f"different numbers of logged steps: {len(this)} this, {len(ref)} ref")
        unequal += 1
    print(f"{len(this)} history entries, {unequal} different")
    return 1 if unequal else 0


if __name__ == "__main__":
    sys.exit(main())
