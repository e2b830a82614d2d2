"""What pre-training BERT-Base and BERT-Large costs in H100 GPU-hours at the paper's settings: an ESTIMATE, printed
as the Markdown table README.md shows (tests/test_readme.py checks that the two agree).

    python benchmarks/cost_table.py

Inputs, each with where it comes from:
- The schedule: configs/bert_large.yaml (the paper's: max_steps 1,000,000, phase1_fraction 0.9, global batch 256 in
  both phases, seq 128 with 20 masked positions, then seq 512 with 80). BERT-Base is the same schedule with
  `model.preset: base`, as in the paper (Devlin et al. 2019, appendix A.2).
- Measured: the product's engine on one H100 80GB HBM3, BERT-Large, bf16, seq 128, micro-batch 256 x accumulation 1:
  ZeRO 1 1,537 and ZeRO 2 1,612 sequences/s (benchmarks/README.md, "On an H100", 2026-11-26). That is the engine
  without Ray and without data loading; the whole stack on a GPU is not measured yet.
- Seq 512 is not measured yet. Estimate: seq 128's figure divided by NVIDIA's published ratio for BERT-Large
  pre-training on one A100 80GB, mixed precision, 580 sequences/s at seq 128 against 210 at seq 512
  (NVIDIA/DeepLearningExamples, PyTorch/LanguageModeling/BERT/README.md, table "Pre-training NVIDIA DGX A100
  (8x A100 80GB)", pytorch:21.11-py3 container). The column "seq 512 at seq 128's MFU" is the cautious variant:
  seq 512 at the same useful FLOP/s as seq 128, i.e. divided by the FLOP ratio of model/flops.py (4.24 for
  BERT-Large) instead of 2.76.
- BERT-Base: BERT-Large's sequences/s times the ratio of useful FLOPs per sequence (model/flops.py), i.e. the same
  useful FLOP/s (MFU) as BERT-Large; a smaller model's smaller matmuls usually reach a lower MFU, so Base's figures
  are the less certain ones.
- Scaling: linear. N cards take GPU-hours / N of wall-clock; no multi-GPU efficiency is measured (NVIDIA's table
  shows 7.9x on 8 A100s for this model). Batch 256 split over more than 4 cards leaves each card a micro-batch under
  64, far from the measured micro-batch 256: on 8, 16 or 64 cards the same number of sequences is trained at a
  larger global batch (bert_large_lamb, or the linear learning-rate rule of infra/README.md, "Scaling to N GPUs").
"""
from __future__ import annotations

from pathlib import Path

import yaml

from bertpipe.model.config import BertConfig
from bertpipe.model.flops import step_flops

PRESET = Path(__file__).resolve().parents[1] / "configs" / "bert_large.yaml"
MEASURED_LARGE_128 = {1: 1537.0, 2: 1612.0}  # seq/s per H100, by ZeRO stage (benchmarks/README.md, 2026-11-26)
NVIDIA_A100_128, NVIDIA_A100_512 = 580.0, 210.0  # BERT-Large, 1 A100 80GB, mixed precision (DeepLearningExamples)
CARDS = (8, 16, 64)
ROWS = (("BERT-Base", "base", 1), ("BERT-Large", "large", 1), ("BERT-Large", "large", 2))


def schedule() -> tuple[list[dict], dict]:
    """(phases with their number of sequences, the preset) from configs/bert_large.yaml."""
    preset = yaml.safe_load(PRESET.read_text())
    pretrain = preset["pretrain"]
    steps = pretrain["max_steps"]
    phase1 = round(steps * pretrain["phase1_fraction"])
    phases = []
    for phase, n_steps in zip(pretrain["phases"], (phase1, steps - phase1)):
        phases.append({"seq": phase["max_seq_length"], "masked": phase["max_predictions_per_seq"],
                       "steps": n_steps, "sequences": n_steps * phase["global_batch_size"]})
    return phases, preset


def throughput(model: str, zero: int, phases: list[dict], vocab: int) -> tuple[float, float, float]:
    """(seq 128, seq 512 by NVIDIA's ratio, seq 512 at seq 128's MFU) sequences/s per H100."""
    large, this = BertConfig.preset("large", vocab_size=vocab), BertConfig.preset(model, vocab_size=vocab)
    short, long = phases
    flops = {name: {p["seq"]: step_flops(cfg, 1, p["seq"], p["masked"]) for p in phases}
             for name, cfg in (("large", large), ("this", this))}
    at_128 = MEASURED_LARGE_128[zero] * flops["large"][short["seq"]] / flops["this"][short["seq"]]
    by_nvidia = at_128 * NVIDIA_A100_512 / NVIDIA_A100_128
    same_mfu = at_128 * flops["this"][short["seq"]] / flops["this"][long["seq"]]
    return at_128, by_nvidia, same_mfu


def wall(hours: float) -> str:
    """Wall-clock of `hours` as `6 h 48 min` or `15 min`."""
    minutes = round(hours * 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def table() -> str:
    phases, preset = schedule()
    vocab = preset["vocab"]["vocab_size"]
    short, long = phases
    head = ("| model (ZeRO stage) | seq/s per H100 at 128 / 512 | H100-hours: phase 1 + phase 2 | "
            + " | ".join(f"{n} H100s" for n in CARDS) + " | H100-hours if seq 512 runs at seq 128's MFU |")
    lines = [head, "|" + "---|" * (4 + len(CARDS))]
    for name, model, zero in ROWS:
        at_128, at_512, cautious_512 = throughput(model, zero, phases, vocab)
        hours_1 = short["sequences"] / at_128 / 3600
        hours_2 = long["sequences"] / at_512 / 3600
        total = hours_1 + hours_2
        cautious = hours_1 + long["sequences"] / cautious_512 / 3600
        walls = " | ".join(wall(total / n) for n in CARDS)
        lines.append(f"| {name} ({zero}) | {at_128:,.0f} / {at_512:,.0f} | {hours_1:.1f} + {hours_2:.1f} = "
                     f"**{total:.0f}** | {walls} | {cautious:.0f} ({cautious_512:,.0f} seq/s at 512) |")
    return "\n".join(lines)


def footer() -> str:
    (short, long), _ = schedule()
    return (f"Schedule: {short['steps']:,} steps at seq {short['seq']} + {long['steps']:,} at seq {long['seq']}, "
            f"{short['sequences'] // short['steps']} sequences per step ({short['sequences'] / 1e6:.1f}M + "
            f"{long['sequences'] / 1e6:.1f}M sequences).")


if __name__ == "__main__":
    print(table())
    print()
    print(footer())
