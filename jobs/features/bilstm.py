"""The feature-based NER model of the BERT paper's comparison (section 5.3): a two-layer bidirectional LSTM over
the frozen per-word features, then a linear layer to the IOB2 labels; trained with Adam on word-level cross
entropy, scored with conlleval. Pure torch."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from bertpipe.jobs.tuning.conll import to_iob2
from bertpipe.jobs.tuning.conlleval import score


class BiLstmTagger(nn.Module):
    def __init__(self, dim: int, hidden: int, num_labels: int, dropout: float = 0.1):
        super().__init__()
        self.lstm = nn.LSTM(dim, hidden, num_layers=2, bidirectional=True, batch_first=True, dropout=dropout)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(2 * hidden, num_labels)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        h, _ = self.lstm(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=x.size(1))
        return self.out(self.dropout(h))  # [B, T, labels]


@dataclass
class BiLstmResult:
    metrics: dict[str, float]
    predicted: list[list[str]]
    train_seconds: float


def _pad(features: list[np.ndarray], rows) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(features[r]) for r in rows])
    x = torch.zeros(len(rows), int(lengths.max()), features[rows[0]].shape[1])
    for j, r in enumerate(rows):
        x[j, :len(features[r])] = torch.from_numpy(features[r])
    return x, lengths


def train_bilstm(train_x: list[np.ndarray], train_tags: list[list[str]], eval_x: list[np.ndarray],
                 eval_tags: list[list[str]], labels: tuple[str, ...], *, hidden: int = 256, epochs: int = 5,
                 lr: float = 1e-3, batch_size: int = 32, seed: int = 1) -> BiLstmResult:
    """Fit on (train features, tags), predict the eval sentences, score them with conlleval."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    label_id = {name: i for i, name in enumerate(labels)}
    ys = [torch.tensor([label_id[t] for t in to_iob2(tags)]) for tags in train_tags]
    model = BiLstmTagger(train_x[0].shape[1], hidden, len(labels))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    t0 = time.perf_counter()
    for _ in range(epochs):
        model.train()
        order = rng.permutation(len(train_x))
        for k in range(0, len(order), batch_size):
            rows = order[k:k + batch_size]
            x, lengths = _pad(train_x, rows)
            y = nn.utils.rnn.pad_sequence([ys[r] for r in rows], batch_first=True, padding_value=-100)
            loss = nn.functional.cross_entropy(model(x, lengths).flatten(0, 1), y.flatten(), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
    seconds = time.perf_counter() - t0
    model.eval()
    predicted = []
    with torch.no_grad():
        for k in range(0, len(eval_x), 128):
            rows = list(range(k, min(k + 128, len(eval_x))))
            x, lengths = _pad(eval_x, rows)
            best = model(x, lengths).argmax(-1)
            predicted += [[labels[i] for i in best[j, :lengths[j]].tolist()] for j in range(len(rows))]
    return BiLstmResult(score(eval_tags, predicted), predicted, seconds)
