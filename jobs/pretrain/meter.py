"""Running pre-training figures of one logging window, summed on each worker and all-reduced when logged."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist


def all_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


@dataclass
class Meter:
    loss: float = 0.0
    mlm_loss: float = 0.0
    nsp_loss: float = 0.0
    mlm_correct: float = 0.0
    mlm_count: float = 0.0
    nsp_correct: float = 0.0
    sequences: float = 0.0
    micro_batches: float = 0.0
    tokens: float = 0.0  # real tokens
    slots: float = 0.0  # real + padding
    data_wait: float = 0.0  # seconds spent waiting for the next batch
    started: float = field(default_factory=time.perf_counter)

    def reset(self) -> None:
        """Start a new logging window."""
        for f in fields(self):
            setattr(self, f.name, time.perf_counter() if f.name == "started" else 0.0)

    def add(self, out, batch: dict[str, torch.Tensor], wait: float) -> None:
        self.loss += out.loss.item()
        self.mlm_loss += out.mlm_loss.item()
        self.nsp_loss += out.nsp_loss.item()
        self.mlm_correct += out.mlm_correct.item()
        self.mlm_count += out.mlm_count.item()
        self.nsp_correct += out.nsp_correct.item()
        self.sequences += batch["input_ids"].shape[0]
        self.micro_batches += 1
        self.tokens += float(batch["attention_mask"].sum())
        self.slots += float(batch["attention_mask"].numel())
        self.data_wait += wait

    def summary(self, device) -> dict[str, float]:
        """Window figures over all workers (a collective: every rank calls it at the same step)."""
        names = [f.name for f in fields(self) if f.name != "started"]
        s = dict(zip(names, all_sum([getattr(self, n) for n in names], device)))
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        micro = max(s["micro_batches"], 1.0)
        return {
            "loss": s["loss"] / micro, "mlm_loss": s["mlm_loss"] / micro, "nsp_loss": s["nsp_loss"] / micro,
            "mlm_accuracy": s["mlm_correct"] / max(s["mlm_count"], 1), "nsp_accuracy": s["nsp_correct"] / max(
                s["sequences"], 1),
            "sequences_per_second": s["sequences"] / elapsed, "tokens_per_second": s["tokens"] / elapsed,
            "data_wait_fraction": s["data_wait"] / dist.get_world_size() / elapsed,
            "padding_fraction": 1.0 - s["tokens"] / max(s["slots"], 1.0),
        }
