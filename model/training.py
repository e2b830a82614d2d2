"""The training rules pre-training and fine-tuning share, in one place.

- Weight decay on matrices and embeddings only: biases and LayerNorm parameters (every tensor of fewer than two
  dimensions) get none, as in google-research/bert's AdamWeightDecayOptimizer exclusion list.
- The learning-rate factor: linear warmup to the peak, then polynomial decay to zero (power 1 = BERT's linear
  decay; NVIDIA's LAMB recipe uses 0.5). Two warmup conventions: google-research/bert's run_classifier and
  transformers' get_linear_schedule_with_warmup give step s the factor s/warmup (0 at the first step, whose
  update then only fills Adam's moments); pre-training here has always used (s+1)/warmup, one step ahead.
- Padded lengths rounded up to a multiple (8: tensor-core friendly shapes).
"""
from __future__ import annotations

from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two optimizer groups: decayed (ndim >= 2) and not decayed (biases, LayerNorm). `parameters()` lists a tied
    weight once, so the MLM decoder tied to the word embedding is not stepped twice."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def dropout_overrides(dropout: float | None) -> dict | None:
    """`load_pretrained` config overrides that set both dropout rates; None keeps the checkpoint's."""
    if dropout is None:
        return None
    return {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}


def warmup_decay(step: int, total: int, warmup: int, power: float = 1.0, from_zero: bool = False) -> float:
    """Factor of the peak learning rate at 0-based `step` of a schedule of `total` steps. `from_zero`: the
    warmup factor is step/warmup (fine-tuning's reference convention), else (step+1)/warmup."""
    if step < warmup:
        return (step if from_zero else step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup)) ** power


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple
