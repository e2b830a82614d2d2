"""Running pre-training figures of one logging window, summed on each worker and all-reduced when logged."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


def all_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


# What a logging window sums on each worker, by name.
SUMS = ("loss", "mlm_loss", "nsp_loss", "mlm_correct", "mlm_count", "nsp_correct", "sequences", "micro_batches",
        "tokens", "slots", "data_wait")  # tokens: real tokens; slots: real + padding; data_wait: seconds


class Meter:
    """Running figures of one logging window on one worker."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Start a new logging window."""
        self.sums = dict.fromkeys(SUMS, 0.0)
        self.started = time.perf_counter()

    def add(self, out, batch: dict[str, torch.Tensor], wait: float) -> None:
        for name in ("loss", "mlm_loss", "nsp_loss", "mlm_correct", "mlm_count", "nsp_correct"):
            self.sums[name] += getattr(out, name).item()
        self.sums["sequences"] += batch["input_ids"].shape[0]
        self.sums["micro_batches"] += 1
        self.sums["tokens"] += float(batch["attention_mask"].sum())
        self.sums["slots"] += float(batch["attention_mask"].numel())
        self.sums["data_wait"] += wait

    def summary(self, device) -> dict[str, float]:
        """Window figures over all workers (a collective: every rank calls it at the same step)."""
        s = dict(zip(SUMS, all_sum([self.sums[n] for n in SUMS], device)))
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        micro = max(s["micro_batches"], 1.0)
        return {
            "loss": s["loss"] / micro, "mlm_loss": s["mlm_loss"] / micro, "nsp_loss": s["nsp_loss"] / micro,
            "mlm_accuracy": s["mlm_correct"] / max(s["mlm_count"], 1),
            "nsp_accuracy": s["nsp_correct"] / max(s["sequences"], 1),
            "sequences_per_second": s["sequences"] / elapsed, "tokens_per_second": s["tokens"] / elapsed,
            "data_wait_fraction": s["data_wait"] / dist.get_world_size() / elapsed,
            "padding_fraction": 1.0 - s["tokens"] / max(s["slots"], 1.0),
        }
