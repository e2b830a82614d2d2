"""Fault injection into Ray Train workers, from the outside: test-only, nothing of it is in the product.

The session's local Ray (conftest `ray_local`) runs `install` in every worker process it starts, through Ray's
`worker_process_setup_hook`. `install` wraps the pre-training loop's `train_step` so that, once a test has armed a
plan (a JSON file in a folder named by an environment variable only this helper reads), the chosen rank dies with
os._exit(1) right after the chosen optimizer step — once per kill planned: the marker file lists the kills done
(with the step the dying process had started from), so the retry (or the rerun) goes past them.
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
    started = {}  # this process's first step: what it resumed from

    def train_step(w, batch, dropout_seed):
        started.setdefault("step", w.engine.global_steps)
        out = original(w, batch, dropout_seed)
        plan_file, marker = os.path.join(folder, PLAN), os.path.join(folder, FIRED)
        if os.path.exists(plan_file):
            kills = json.loads(Path(plan_file).read_text())["kills"]
            done = _kills_done(marker)
            if len(done) < len(kills):
                kill = kills[len(done)]
                if w.engine.global_steps == kill["step"] and w.rank == min(kill["rank"], w.world - 1):
                    Path(marker).write_text(json.dumps([*done, {**kill, "started_at": started["step"]}]))
                    os._exit(1)  # a crash, not an exception: Ray sees the worker process die
        return out

    loop.train_step = train_step
    _wrap_trials(folder)


def _kills_done(marker: str) -> list[dict]:
    return json.loads(Path(marker).read_text() or "[]") if os.path.exists(marker) else []


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

    def arm(self, *, step: int, rank: int = 1, then: tuple[int, int] | None = None) -> None:
        """Rank `rank` dies after optimizer step `step`; `then` = (step, rank): a second death, in the attempt
        that follows (the retry)."""
        kills = [{"step": step, "rank": rank}] + ([{"step": then[0], "rank": then[1]}] if then else [])
        (self.folder / FIRED).unlink(missing_ok=True)
        (self.folder / PLAN).write_text(json.dumps({"kills": kills}))

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

    @property
    def kills(self) -> list[dict]:
        """The kills done, in order: {"step", "rank", "started_at": the step the dying process had started from}."""
        return _kills_done(str(self.folder / FIRED))
