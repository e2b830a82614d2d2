"""Does pre-training help? The `mini` preset's pre-trained export vs the same architecture from random
initialisation, fine-tuned on SST-2, MRPC, CoLA and STS-B (GLUE dev sets) with the same recipe, data and seeds.

    .venv/bin/python benchmarks/bench_pretrain_value.py --export 4400=work/mini/pretrain/export \
        --checkpoint 400=work/mini/ray_results/pretrain-<id>/checkpoint_<time of step 400> [--checkpoint ...]

Each --export NAME=DIR is one pre-trained model (NAME: e.g. its pre-training steps); each --checkpoint NAME=DIR is
an earlier budget of the same run (the `mini` preset keeps every checkpoint; `position.json` in each says its
step), exported with the first export's config and vocabulary. The random-initialised
model takes the first export's config.json and vocabulary, its weights drawn with the trial's seed (BERT's
truncated-normal 0.02 init, as pre-training starts from). Every arm runs the project's own fine-tuning trial
(jobs/tuning/loop.py on jobs/glue/trial.py's GlueTask) with identical hyper-parameters, training subset and seed.
The table gives the dev score (x100: SST-2 accuracy, MRPC mean of F1 and accuracy, CoLA Matthews correlation,
STS-B mean of Pearson and Spearman) as mean +/- sd over seeds, and whether each export is ahead of random init by
more than the pooled sd (sqrt((sd_a^2 + sd_b^2) / 2)). Needs the GLUE folders in ../shared/data/glue (or --glue).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bertpipe.jobs.glue.config import GlueConfig  # noqa: E402
from bertpipe.jobs.glue.tasks import TASKS, read_task  # noqa: E402
from bertpipe.jobs.glue.trial import GlueTask  # noqa: E402
from bertpipe.jobs.tuning.loop import run_trial  # noqa: E402

GLUE = REPO.parent / "shared" / "data" / "glue"
RANDOM = "random"


def random_init_dir(export: Path, seed: int, root: Path) -> Path:
    """The export's architecture and vocabulary with freshly initialised weights (seeded)."""
    from bertpipe.model import BertForPreTraining, load_pretrained, save_pretrained

    config = load_pretrained(export, BertForPreTraining).config
    torch.manual_seed(seed)
    out = root / f"random-{seed}"
    save_pretrained(BertForPreTraining(config), out, export / "vocab.txt")
    return out


def export_from_checkpoint(ckpt: Path, like: Path, out: Path) -> Path:
    """An HF-layout export of a pre-training checkpoint (a Ray Train `checkpoint_*` folder of the pretrain stage,
    ZeRO 0-2: rank 0's model states hold the whole module), with `like`'s config and vocabulary."""
    from bertpipe.model import BertForPreTraining, load_pretrained, save_pretrained

    states = ckpt / "ckpt" / "mp_rank_00_model_states.pt"
    if not states.is_file():
        sys.exit(f"--checkpoint {ckpt}: no {states.relative_to(ckpt)} (a ZeRO-3 checkpoint, or not a pretrain one?)")
    model = BertForPreTraining(load_pretrained(like, BertForPreTraining).config)
    model.load_state_dict(torch.load(states, map_location="cpu", weights_only=False)["module"])
    save_pretrained(model, out, like / "vocab.txt")
    return out


def mean_sd(xs: list[float]) -> tuple[float, float]:
    return float(np.mean(xs)), float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0


def run_all(args, exports: dict[str, Path]) -> dict[str, dict[str, list[float]]]:
    """{task: {arm: [dev score x100 per seed]}}; prints one line per trial."""
    recipe = GlueConfig(batch_size=args.batch_size, num_epochs=args.epochs, max_seq_length=args.max_seq_length,
                            max_train_examples=args.train_examples, cpus_per_trial=args.threads, dropout=args.dropout)
    scores: dict[str, dict[str, list[float]]] = {}
    first = next(iter(exports.values()))
    with tempfile.TemporaryDirectory() as tmp:
        randoms = {s: random_init_dir(first, s, Path(tmp)) for s in args.seeds}
        for task in args.tasks:
            data = GlueTask(read_task(str(args.glue), TASKS[task], with_test=False))
            scores[task] = {}
            for arm, model_dir in [(RANDOM, None), *exports.items()]:
                for seed in args.seeds:
                    t0 = time.perf_counter()
                    r = run_trial(randoms[seed] if model_dir is None else model_dir, data, args.lr, seed, recipe)
                    scores[task].setdefault(arm, []).append(100 * r.score)
                    print(f"  {task:6s} {arm:>10s} seed {seed}: {100 * r.score:6.2f}  "
                          f"({r.num_train} train, {time.perf_counter() - t0:.0f} s)", flush=True)
    return scores


def table(scores: dict[str, dict[str, list[float]]], exports: list[str]) -> tuple[str, dict[str, int]]:
    head = f"| task | {RANDOM} | " + " | ".join(f"pre-trained {e} | gap | pooled sd | ahead?" for e in exports) + " |"
    lines = [head, "|" + "---|" * (2 + 4 * len(exports))]
    ahead = dict.fromkeys(exports, 0)
    for task, arms in scores.items():
        rm, rs = mean_sd(arms[RANDOM])
        cells = [task, f"{rm:.1f} ± {rs:.1f}"]
        for e in exports:
            pm, ps = mean_sd(arms[e])
            pooled = float(np.sqrt((rs ** 2 + ps ** 2) / 2))
            yes = pm - rm > pooled
            ahead[e] += yes
            cells += [f"{pm:.1f} ± {ps:.1f}", f"{pm - rm:+.1f}", f"{pooled:.1f}", "yes" if yes else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), ahead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", action="append", required=True, metavar="NAME=DIR",
                    help="a pre-trained export (HF layout); repeat for several pre-training budgets")
    ap.add_argument("--checkpoint", action="append", metavar="NAME=DIR",
                    help="an intermediate budget: a pretrain `checkpoint_*` folder (keep more with "
                         "--set pretrain.num_checkpoints_to_keep=N), exported with the first --export's config")
    ap.add_argument("--glue", type=Path, default=GLUE)
    ap.add_argument("--tasks", nargs="+", default=["SST-2", "MRPC", "CoLA", "STS-B"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--train-examples", type=int, default=2000, help="training subset per trial (0 = all)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-seq-length", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=None,
                    help="fine-tuning dropout for every arm (default: each export's config.json, 0 for a mini export)")
    ap.add_argument("--json", type=Path, help="write the per-seed scores here")
    args = ap.parse_args()
    exports = {}
    for item in args.export:
        name, _, path = item.partition("=")
        if not (Path(path) / "config.json").is_file():
            sys.exit(f"--export {item}: {path} has no config.json (an HF-layout export folder?)")
        exports[name] = Path(path)
    converted, budgets = tempfile.TemporaryDirectory(), {}
    for item in args.checkpoint or []:  # smaller budgets first in the table
        name, _, path = item.partition("=")
        budgets[name] = export_from_checkpoint(Path(path), next(iter(exports.values())), Path(converted.name) / name)
    exports = {**budgets, **exports}
    missing = [t for t in args.tasks if not (args.glue / t / "train.tsv").is_file()]
    if missing:
        sys.exit(f"{args.glue} lacks {missing}: point --glue at a GLUE download")
    print(f"fine-tuning: {args.train_examples or 'all'} train examples, {args.epochs} epochs, lr {args.lr}, "
          f"batch {args.batch_size}, seq {args.max_seq_length}, seeds {args.seeds}", flush=True)
    t0 = time.perf_counter()
    scores = run_all(args, exports)
    text, ahead = table(scores, list(exports))
    print(text)
    for e, n in ahead.items():
        print(f"pre-trained {e} ahead of random init by more than the pooled sd on {n} of {len(scores)} tasks")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(scores, indent=1))


if __name__ == "__main__":
    main()
