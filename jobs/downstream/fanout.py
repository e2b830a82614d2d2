"""The learning-rate x seed fan-out of a downstream job (SQuAD, NER) on Ray, as GLUE's: one Ray task per trial
with `cpus_per_trial` CPUs, at most `max_concurrent_trials` at once, one MLflow child run per trial below the
stage's run, the best trial by its dev score, and a Markdown table of the grid.

A trial body is a module-level function `body(model_dir, data, learning_rate, seed, recipe, on_epoch)` that
returns an object with `.score` (the selection key) and `.metrics` (dict of floats).
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

from bertpipe.jobs.tracking import RunLogger
from bertpipe.pipeline.progress import Progress

log = logging.getLogger("bertpipe.downstream")


@dataclass
class GridTrial:
    key: str           # "lr=5e-05/seed=1"
    learning_rate: float
    sweep_seed: int    # the seed value of the sweep
    seed: int          # the trial's RNG seed: sweep seed mixed with the workflow seed and the job
    run: RunLogger


def trial_seed(workflow_seed: int, job: str, seed: int) -> int:
    digest = hashlib.sha256(f"{workflow_seed}/{job}/{seed}".encode()).hexdigest()
    return int(digest[:8], 16)


def plan_grid(job: str, recipe, workflow_seed: int, parent: RunLogger) -> list[GridTrial]:
    trials = []
    for sweep_seed in recipe.seeds:
        for lr in recipe.learning_rates:
            seed = trial_seed(workflow_seed, job, sweep_seed)
            run = parent.child(f"{job}-lr{lr:g}-seed{sweep_seed}", {"bertpipe.kind": f"{job}_trial"})
            run.log_params({"learning_rate": lr, "seed": seed, "sweep_seed": sweep_seed, "recipe": recipe})
            trials.append(GridTrial(f"lr={lr:g}/seed={sweep_seed}", lr, sweep_seed, seed, run))
    return trials


def _remote_body(body: Callable, model_files: dict[str, bytes], data: Any, lr: float, seed: int, recipe,
                 coordinates: dict[str, str]):
    """What one Ray task runs: the model files written to a local folder, the trial, its epochs logged."""
    run = RunLogger(coordinates)
    with tempfile.TemporaryDirectory(prefix="bertpipe-ds-") as tmp:
        for name, blob in model_files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(blob)
        return body(tmp, data, lr, seed, recipe, lambda epoch, row: run.log_metrics(row, step=epoch))


def run_grid(job: str, body: Callable, model_ref, data_ref, trials: list[GridTrial], recipe) -> list[Any]:
    """Every trial's result, or its exception, in order; progress shows the best score so far."""
    import ray

    remote = ray.remote(_remote_body).options(num_cpus=recipe.cpus_per_trial, num_gpus=recipe.gpus_per_trial,
                                              max_retries=0)
    limit = recipe.max_concurrent_trials or len(trials)
    results: list[Any] = [None] * len(trials)
    running: dict[Any, int] = {}
    next_trial = 0
    progress = Progress(job, len(trials), "trials", lambda f: f"best {100 * f['best']:.2f}" if "best" in f else "")
    best = float("-inf")
    while next_trial < len(trials) or running:
        while next_trial < len(trials) and len(running) < limit:
            t = trials[next_trial]
            coords = t.run.coordinates if t.run.active else {}
            running[remote.remote(body, model_ref, data_ref, t.learning_rate, t.seed, recipe, coords)] = next_trial
            next_trial += 1
        ready, _ = ray.wait(list(running), num_returns=1)
        i = running.pop(ready[0])
        try:
            results[i] = ray.get(ready[0])
            best = max(best, results[i].score)
            log.info("%s: trial %s done: score %.4f", job, trials[i].key, results[i].score)
        except Exception as e:  # noqa: BLE001 - one trial failing must not stop the sweep
            results[i] = e
            log.warning("%s: trial %s failed: %s", job, trials[i].key, e)
        trials[i].run.end(not isinstance(results[i], BaseException))
        progress.add(1, **({"best": best} if best > float("-inf") else {}))
    progress.close()
    return results


def best_of(trials: list[GridTrial], results: list[Any]) -> tuple[GridTrial, Any]:
    """The trial with the highest score (the first on ties); ValueError if every trial failed."""
    ok = [(t, r) for t, r in zip(trials, results) if not isinstance(r, BaseException)]
    if not ok:
        errors = "; ".join(f"{t.key}: {type(r).__name__}: {r}" for t, r in zip(trials, results))
        raise RuntimeError(f"every trial failed ({errors[:2000]})")
    return max(ok, key=lambda tr: tr[1].score)


def grid_table(trials: list[GridTrial], results: list[Any], metric_names: tuple[str, ...]) -> str:
    """Markdown: one row per trial (learning rate, seed, metrics in %, train seconds), failures with their error."""
    head = "| learning rate | seed | " + " | ".join(metric_names) + " | train s |"
    lines = [head, "|" + "---|" * (len(metric_names) + 3)]
    for t, r in zip(trials, results):
        if isinstance(r, BaseException):
            lines.append(f"| {t.learning_rate:g} | {t.sweep_seed} | failed: {type(r).__name__}: {r} |")
            continue
        cells = " | ".join(f"{100 * r.metrics[m]:.2f}" for m in metric_names)
        lines.append(f"| {t.learning_rate:g} | {t.sweep_seed} | {cells} | {r.train_seconds:.1f} |")
    return "\n".join(lines) + "\n"
