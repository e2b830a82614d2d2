"""Held-out evaluation of a pre-training worker: MLM and NSP accuracy with fixed masks, summed over all workers, and
what one costs before the first ran (timed on a CPU before the first step, for the ETA)."""
from __future__ import annotations

import time

import torch

from bertpipe.jobs.pretrain.config import PhaseConfig
from bertpipe.jobs.pretrain.engine.build import compile_enabled
from bertpipe.jobs.pretrain.data.masking import batch_rng, mask_batch
from bertpipe.jobs.pretrain.metrics.meter import all_sum
from bertpipe.jobs.pretrain.worker import Worker, forward, masking_spec, to_device

EVAL_PHASE = 99  # the masking seed's "phase" part for held-out evaluation: fixed masks, never a training phase


def evaluate_heldout(w: Worker, phase: PhaseConfig, training_masks: bool = True) -> dict[str, float]:
    """Held-out MLM/NSP accuracy with a fixed masking seed, summed over all workers (every rank runs the same
    number of forwards: ZeRO-3 gathers parameters collectively)."""
    batches = w.data.heldout_batches(phase)
    spec = masking_spec(w, phase, training_masks)
    if compile_enabled(w.spec.pretrain) and not w.eval_compiled:
        w.metrics.tell(w.engine.global_steps, status="compiling the model for evaluation (first evaluation)")
    w.eval_compiled = True
    names = ("mlm_correct", "mlm_count", "nsp_correct", "mlm_loss")
    totals = torch.zeros(len(names), dtype=torch.float64, device=w.device)  # summed on the device, read once below
    sequences = 0  # known on the host: no device tensor needed
    w.engine.eval()
    with torch.no_grad():
        for i, raw in enumerate(batches):
            out = forward(w, to_device(mask_batch(raw, spec, batch_rng(w.spec.seed, EVAL_PHASE, 0, w.rank, i)),
                                       w.device))
            totals += torch.stack([out.mlm_correct.float(), out.mlm_count.float(), out.nsp_correct.float(),
                                   out.mlm_loss.detach().float() * out.mlm_count.float()]).double()
            sequences += len(raw["next_sentence_label"])
    w.engine.train()
    s = dict(zip(names + ("sequences",), all_sum([*totals.tolist(), float(sequences)], w.device)))
    return {"eval_mlm_accuracy": s["mlm_correct"] / max(s["mlm_count"], 1),
            "eval_nsp_accuracy": s["nsp_correct"] / max(s["sequences"], 1),
            "eval_mlm_loss": s["mlm_loss"] / max(s["mlm_count"], 1), "eval_sequences": s["sequences"]}


def time_eval_batches(w: Worker) -> None:
    """On a CPU, one held-out batch of each phase through the model, timed: what an evaluation costs before the first
    one ran (eta.py). Pricing it from the training step instead (a forward is a third of a step's work per sequence)
    holds where compute dominates a step; on a CPU's small models the optimizer and the all-reduce do, and the
    evaluations came out 2-3 times dearer than they were. The batch goes through once untimed first: the first
    forward at a new sequence length allocates its buffers, which no evaluation batch after it does. Not on a GPU:
    the rule holds there, and a compiled model's first evaluation compiles (its timing would be the compiler's)."""
    if w.device.type != "cpu" or compile_enabled(w.spec.pretrain):
        return
    cfg = w.spec.pretrain
    w.engine.eval()
    with torch.no_grad():
        for q, (phase, steps) in enumerate(zip(cfg.phases, cfg.phase_steps())):
            batches = w.data.heldout_batches(phase) if steps else []
            if batches:
                rng = batch_rng(w.spec.seed, EVAL_PHASE, 0, w.rank, 0)
                batch = to_device(mask_batch(batches[0], masking_spec(w, phase, False), rng), w.device)
                forward(w, batch)
                started = time.perf_counter()
                forward(w, batch)
                w.metrics.measured.eval_batch_s[q] = time.perf_counter() - started
    w.engine.train()
