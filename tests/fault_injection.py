"""Fault injection into Ray Train workers, from the outside: test-only, nothing of it is in the product.

The session's local Ray (conftest `ray_local`) runs `install` in every worker process it starts, through Ray's
`worker_process_setup_hook`. `install` wraps the pre-training loop's `train_step` so that, once a test has armed a
plan (a JSON file in a folder named by an environment variable only this helper reads), the chosen rank dies with
os._exit(1) right after the chosen optimizer step — once: a marker file keeps the retry (or the rerun) alive.
It also wraps the downstream fan-out's trial (SQuAD, NER): armed with a learning rate, the trial of that learning
rate raises once, as a trial that hits a bug or runs out of memory would.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

FAULT_DIR_ENV = "BERTPIPE_TEST_FAULT_DIR"
PLAN, FIRED = "plan.json", "fired"
TRIAL_PLAN = "trial-plan.json"


def install() -> None:
    folder = os.environ.get(FAULT_DIR_ENV)
    if not folder:
        return
    from bertpipe.jobs.pretrain import loop

    original = loop.train_step

    def train_step(w, batch, dropout_seed):
        out = original(w, batch, dropout_seed)
        plan_file, marker = os.path.join(folder, PLAN), os.path.join(folder, FIRED)
        if os.path.exists(plan_file) and not os.path.exists(marker):
            plan = json.loads(Path(plan_file).read_text())
            if w.engine.global_steps == plan["step"] and w.rank == min(plan["rank"], w.world - 1):
                Path(marker).touch()
                os._exit(1)  # a crash, not an exception: Ray sees the worker process die
        return out

    loop.train_step = train_step
    _wrap_trials(folder)


def _wrap_trials(folder: str) -> None:
    """The Ray task of a fine-tuning trial, resolved by name on the worker, raises once for the armed rate."""
    from bertpipe.jobs.tuning import fanout

    original = fanout._trial_body

    def _trial_body(model_files, task, lr, *args):
        plan_file, marker = os.path.join(folder, TRIAL_PLAN), os.path.join(folder, FIRED)
        if os.path.exists(plan_file) and not os.path.exists(marker):
            if lr == json.loads(Path(plan_file).read_text())["learning_rate"]:
                Path(marker).touch()
                raise RuntimeError(f"injected fault in the trial at learning rate {lr:g}")
        return original(model_files, task, lr, *args)

    fanout._trial_body = _trial_body


class Faults:
    def __init__(self, folder: Path):
        self.folder = folder

    def arm(self, *, step: int, rank: int = 1) -> None:
        (self.folder / FIRED).unlink(missing_ok=True)
        (self.folder / PLAN).write_text(json.dumps({"step": step, "rank": rank}))

    def arm_trial(self, *, learning_rate: float) -> None:
        (self.folder / FIRED).unlink(missing_ok=True)
        (self.folder / TRIAL_PLAN).write_text(json.dumps({"learning_rate": learning_rate}))

    def disarm(self) -> None:
        (self.folder / PLAN).unlink(missing_ok=True)
        (self.folder / TRIAL_PLAN).unlink(missing_ok=True)
        (self.folder / FIRED).unlink(missing_ok=True)

    @property
    def fired(self) -> bool:
        return (self.folder / FIRED).exists()
