"""Useful training FLOPs of a BERT pre-training step, and the bf16 peaks of the cards it is measured against.

A step's useful work is its matmuls, forward and backward (6 FLOPs per weight and row):
    6 · (the encoder's matmul weights) · B · T          (T padded: what the model computes on)
  + 6 · (H² + V · H) · B · P                            (MLM transform and tied vocabulary projection, where a label is)
  + 6 · (H² + 2H) · B                                   (pooler and NSP classifier, on [CLS])
  + 12 · L · B · T² · H                                 (attention scores and the weighted sum)
Biases, embeddings (lookups), layer norms and softmax are not counted, as in the PaLM paper's model-FLOPs
definition; torch's FlopCounterMode counts the same (tests/test_flops.py). Recomputed activations (activation
checkpointing) are not useful work, so they do not count either: MFU falls when they are on, which is their cost.
"""
from __future__ import annotations

from bertpipe.model.config import BertConfig


def step_flops(config: BertConfig, batch: int, seq: int, masked: int) -> float:
    """Useful FLOPs of forward + backward on `batch` sequences padded to `seq` with `masked` gathered positions
    each (the MLM head's P): 2 per multiply-add forward, twice that backward (input and weight gradients)."""
    H, I, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    per_token = L * (4 * H * H + 2 * H * I)  # Q, K, V, attention output; the two feed-forward matmuls
    attention = L * 2 * seq * seq * H  # scores (T × T × H) and the weighted sum, per sequence
    per_masked = H * H + V * H  # the MLM transform and the tied vocabulary projection, on gathered positions only
    per_sequence = H * H + 2 * H  # pooler and NSP classifier, on [CLS] only
    return 6.0 * (per_token * batch * seq + per_masked * batch * masked + per_sequence * batch + attention * batch)


# Dense bf16 tensor-core peaks of the spec sheets, TFLOP/s per card (no sparsity), by a name fragment as
# torch.cuda.get_device_name reports it; the first fragment found in the name wins, so longer names come first.
BF16_PEAK_TFLOPS = (
    ("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("B200", 2250.0),
    ("A100", 312.0), ("A10G", 70.0), ("A10", 125.0), ("L40S", 362.0), ("L4", 121.0),
    ("RTX 4090", 165.0), ("RTX 3090", 71.0),
)


def peak_tflops(device_name: str) -> float | None:
    """The card's dense bf16 peak from its name, None for a card (or a CPU) not in the table."""
    for fragment, peak in BF16_PEAK_TFLOPS:
        if fragment in device_name:
            return peak
    return None
