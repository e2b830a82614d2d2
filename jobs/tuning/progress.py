"""The driver's progress line of a fan-out: optimizer steps over every trial (each trial reports its own steps
through a Reporter, about every 2 s), the trial that reported last with its epoch and loss, the best score so
far. Trials learn their step count once they have built their training rows, so the total starts as an estimate
(the mean of the known trials for the others) and the ETA sharpens as trials start."""
from __future__ import annotations

import time
from typing import Any

from bertpipe.pipeline.framework.console import Console
from bertpipe.pipeline.framework.progress import POLL_S, Reporter


class TrialsProgress:
    poll_s = POLL_S

    def __init__(self, console: Console, stage: str, trials: list):
        self.stage, self.trials = stage, list(trials)
        self.board = console.board() if console.live else None
        self.tag = f"{stage}-{time.monotonic_ns()}"
        self.state: dict[str, tuple[float, dict[str, Any]]] = {}  # trial key -> (steps, fields)
        self.finished: set[str] = set()
        self.best = float("-inf")
        self.shown = console.progress(stage, None, "steps", self._describe)
        self.last_key = ""

    def __enter__(self) -> "TrialsProgress":
        return self

    def __exit__(self, *exc) -> None:
        if self.board is not None:
            for t in self.trials:
                self.board.drop.remote(self._board_key(t))
        self.shown.close()

    def _board_key(self, trial) -> str:
        return f"{self.tag}/{trial.key}"

    def reporter(self, trial) -> Reporter:
        return Reporter(self.board, self._board_key(trial))

    def poll(self) -> None:
        """Read the running trials' reports (one actor call each) and refresh the line."""
        if self.board is None:
            return
        import ray

        running = [t for t in self.trials if t.key not in self.finished]
        try:
            got = ray.get([self.board.read.remote(self._board_key(t)) for t in running], timeout=10)
        except Exception:  # noqa: BLE001 - a slow poll must never break the sweep it watches
            return
        for t, (count, fields) in zip(running, got):
            if count and (count, fields) != self.state.get(t.key):
                self.last_key = t.key
            self.state[t.key] = (count, fields)
        self._show()

    def done(self, trial) -> None:
        self.finished.add(trial.key)
        result = trial.result
        count, fields = self.state.get(trial.key, (0.0, {}))
        if hasattr(result, "num_steps"):
            self.best = max(self.best, result.score)
            count, fields = float(result.num_steps), {**fields, "total": result.num_steps}
        self.state[trial.key] = (count, fields)
        self._show()

    def _show(self) -> None:
        totals = [f["total"] for _, f in self.state.values() if "total" in f]
        unknown = len(self.trials) - len(totals)
        total = sum(totals) + (unknown * sum(totals) / len(totals) if totals else 0)
        self.shown.total = total or None
        if self.shown.bar is not None:
            self.shown.bar.total = self.shown.total
        self.shown.set(sum(c for c, _ in self.state.values()))

    def _describe(self, _: dict) -> str:
        parts = [f"trials {len(self.finished)}/{len(self.trials)}"]
        count, fields = self.state.get(self.last_key, (0.0, {}))
        if self.last_key and self.last_key not in self.finished and fields:
            loss = fields.get("loss", float("nan"))
            parts.append(f"{self.last_key} epoch {fields.get('epoch', '?')} loss {loss:.4f}")
        if self.best > float("-inf"):
            parts.append(f"best {100 * self.best:.2f}")
        return " · ".join(parts)
