"""The learning-rate x seed fan-out of a downstream job (SQuAD, NER) on Ray, as GLUE's: one Ray task per trial
with `cpus_per_trial` CPUs, at most `max_concurrent_trials` at once, one MLflow child run per trial below the
stage's run, the best trial by its dev score, and a Markdown table of the grid.

A trial body is a module-level function `body(model_dir, data, learning_rate, seed, recipe, on_epoch)` that
returns a dataclass with `.score` (the selection key) and `.metrics` (dict of floats).

Every requested trial must succeed: the best learning rate of a grid with holes is not the one asked for. A failed
trial fails the stage (failures.TrialsFailed names each); the finished ones are kept under `_trials/`
(pipeline/parts.py) and the rerun with the same config runs only the rest.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

from bertpipe.jobs.downstream import failures, kept
from bertpipe.jobs.tracking import RunLogger
from bertpipe.pipeline import parts
from bertpipe.pipeline.progress import Progress
from bertpipe.pipeline.stage import StageContext

log = logging.getLogger("bertpipe.downstream")


@dataclass
class GridTrial:
    key: str           # "lr=5e-05/seed=1"
    learning_rate: float
    sweep_seed: int    # the seed value of the sweep
    seed: int          # the trial's RNG seed: sweep seed mixed with the workflow seed and the job
    run: RunLogger
    part: str = ""     # its folder for pipeline/parts.py, relative to the stage's
    cache_key: str = ""  # the key its kept result is valid for (jobs/downstream/kept.py)


def trial_seed(workflow_seed: int, job: str, seed: int) -> int:
    digest = hashlib.sha256(f"{workflow_seed}/{job}/{seed}".encode()).hexdigest()
    return int(digest[:8], 16)


def plan_grid(job: str, recipe, ctx: StageContext, parent: RunLogger, base: dict,
              result_cls: type) -> tuple[list[GridTrial], list[Any]]:
    """The grid's trials and, for each, the result a failed run kept under the same key (None: it runs, in a child
    run of `parent`). A part of another config, or a half-written one, is deleted: this run rewrites it."""
    trials, results = [], []
    for sweep_seed in recipe.seeds:
        for lr in recipe.learning_rates:
            key = f"lr={lr:g}/seed={sweep_seed}"
            part, cache_key = parts.part_path(*key.split("/")), kept.trial_key(base, lr, sweep_seed)
            done = kept.restore(ctx.output_uri, part, cache_key, result_cls)
            seed = trial_seed(ctx.seed, job, sweep_seed)
            if done is None:
                parts.drop(ctx.output_uri, part)
                run = parent.child(f"{job}-lr{lr:g}-seed{sweep_seed}", {"bertpipe.kind": f"{job}_trial"})
                run.log_params({"learning_rate": lr, "seed": seed, "sweep_seed": sweep_seed, "recipe": recipe})
            else:
                run = RunLogger(None)
            trials.append(GridTrial(key, lr, sweep_seed, seed, run, part, cache_key))
            results.append(done)
    parts.drop_all_but(ctx.output_uri, {t.part for t, r in zip(trials, results) if r is not None})
    if any(r is not None for r in results):
        parent.set_tag("bertpipe.kept_trials", ", ".join(t.key for t, r in zip(trials, results) if r is not None))
    return trials, results


def sweep(job: str, body: Callable, ctx: StageContext, recipe, model_files: dict[str, bytes], data: Any,
          data_files: list[dict], result_cls: type, parent: RunLogger) -> tuple[list[GridTrial], list[Any]]:
    """Every trial of the grid, kept ones reused and the rest run; each one that finishes is committed as a part.
    (trials, results) when all succeeded; failures.TrialsFailed naming each failed trial otherwise."""
    import ray

    base = kept.base_key(job, recipe, ctx.seed, kept.files_digest(model_files), data_files)
    trials, results = plan_grid(job, recipe, ctx, parent, base, result_cls)
    todo = [i for i, r in enumerate(results) if r is None]
    log.info("%s: %d trials to run, %d kept from a failed run", job, len(todo), len(trials) - len(todo))

    def done(k: int, result: Any) -> None:  # as each trial ends: commit it, or delete what it half wrote
        i = todo[k]
        results[i] = result
        if isinstance(result, BaseException):
            parts.drop(ctx.output_uri, trials[i].part)
        else:
            kept.save(ctx.output_uri, trials[i].part, trials[i].cache_key, result)

    if todo:
        run_grid(job, body, ray.put(model_files), ray.put(data), [trials[i] for i in todo], recipe, done)
    failed = {t.key: failures.cause_line(r) for t, r in zip(trials, results) if isinstance(r, BaseException)}
    if failed:
        raise failures.requested_failed(f"{job} trials", failed, len(trials), ctx.output_uri,
                                        parts.count(ctx.output_uri), input_only=False)
    return trials, results


def _remote_body(body: Callable, model_files: dict[str, bytes], data: Any, lr: float, seed: int, recipe,
                 coordinates: dict[str, str]):
    """What one Ray task runs: the model files written to a local folder, the trial, its epochs logged."""
    run = RunLogger(coordinates)
    with tempfile.TemporaryDirectory(prefix="bertpipe-ds-") as tmp:
        for name, blob in model_files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(blob)
        return body(tmp, data, lr, seed, recipe, lambda epoch, row: run.log_metrics(row, step=epoch))


def run_grid(job: str, body: Callable, model_ref, data_ref, trials: list[GridTrial], recipe,
             on_done: Callable[[int, Any], None] | None = None) -> list[Any]:
    """Every trial's result, or its exception, in order; progress shows the best score so far. `on_done(index,
    result or exception)` as each trial ends (a sweep stopped half way keeps what finished)."""
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
            # The log file gets the remote traceback; the console gets the stage's one-line error at the end.
            log.info("%s: trial %s failed: %s", job, trials[i].key, e)
            trials[i].run.set_tag("bertpipe.error", failures.cause_line(e))
        trials[i].run.end(not isinstance(results[i], BaseException))
        if on_done is not None:
            on_done(i, results[i])
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
