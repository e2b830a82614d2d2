"""Dynamic masking: a batch of unpadded shard rows → padded model inputs with fresh MLM targets.

The BERT recipe (google-research/bert `create_masked_lm_predictions`): of the non-special tokens of a
sequence, ~15% (at least 1, at most max_predictions_per_seq) are chosen; a chosen token becomes [MASK] with
probability 0.8, a random token with 0.1, and stays itself with 0.1; the model must predict the original.
With whole-word masking a word's "##" continuation pieces are chosen together with its first piece.

Differences from the original, on purpose:
- Masking happens at load time (a new mask every epoch) instead of `dupe_factor` static copies on disk.
- The random replacement is drawn from non-special tokens only (the original can put [CLS]/[SEP] in text).
- The number to predict is 15% of the *non-special* tokens (the original counts [CLS]/[SEP] too).
Every batch gets its own generator seeded by (seed, phase, epoch, rank, batch index), so skipping the first
k batches of an epoch on resume reproduces exactly the masks an uninterrupted run would have drawn.

Pure numpy/torch, no Ray: a test calls `mask_batch` on an in-memory batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bertpipe.model.bert import IGNORE_INDEX
from bertpipe.model.training import round_up
from bertpipe.pipeline.formats.tokenizer import SPECIAL_TOKENS



@dataclass(frozen=True)
class MaskingSpec:
    vocab_size: int
    pad_id: int
    mask_id: int
    special_ids: tuple[int, ...]  # never masked, never drawn as the random replacement
    max_seq_length: int
    max_predictions: int
    masked_lm_prob: float = 0.15
    # bool [vocab_size]: token is a "##" continuation piece. None = token-level masking.
    continuation: np.ndarray | None = None
    # Sequences are padded to a multiple of this (tensor-core friendly shapes), never beyond it.
    pad_to_multiple_of: int = 8

    @classmethod
    def from_vocab(cls, tokens: list[str], *, max_seq_length: int, max_predictions: int,
                   masked_lm_prob: float = 0.15, whole_word: bool = False) -> MaskingSpec:
        index = {t: i for i, t in enumerate(tokens)}
        missing = [t for t in SPECIAL_TOKENS if t not in index]
        if missing:
            raise ValueError(f"vocabulary lacks the special tokens {missing}")
        return cls(vocab_size=len(tokens), pad_id=index["[PAD]"], mask_id=index["[MASK]"],
                   special_ids=tuple(index[t] for t in SPECIAL_TOKENS), max_seq_length=max_seq_length,
                   max_predictions=max_predictions, masked_lm_prob=masked_lm_prob,
                   continuation=np.array([t.startswith("##") for t in tokens]) if whole_word else None)

    def replacement_ids(self) -> np.ndarray:
        keep = np.ones(self.vocab_size, dtype=bool)
        keep[list(self.special_ids)] = False
        return np.flatnonzero(keep)


def batch_rng(seed: int, phase: int, epoch: int, rank: int, batch_index: int) -> np.random.Generator:
    """The generator of one batch: independent of every other batch, so batches can be skipped on resume."""
    return np.random.default_rng([seed, phase, epoch, rank, batch_index])


def seed_of(*parts: int) -> int:
    """One integer seed of (the run's seed, phase, epoch, rank, ...): an epoch stream's shuffle and binning seeds
    (streams.py) and a micro-batch's dropout seed (loop.py), each independent of the others as batch_rng's are."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def _rows(column: Any) -> list[np.ndarray]:
    # Ray Data hands a list<uint16> column over as an object array of arrays (or 2-D if all rows are equal).
    return [np.asarray(r, dtype=np.int64) for r in column]


def pad_batch(batch: dict[str, Any], spec: MaskingSpec) -> dict[str, np.ndarray]:
    """input_ids/token_type_ids/attention_mask [B, T] int64 with T = longest row rounded up to
    pad_to_multiple_of; next_sentence_label [B]. Rows longer than max_seq_length → ValueError."""
    rows = _rows(batch["input_ids"])
    lengths = np.array([len(r) for r in rows], dtype=np.int64)  # [B]
    if len(rows) == 0 or lengths.min() < 3:
        raise ValueError("a batch needs rows of at least [CLS] A [SEP] (3 tokens)")
    if lengths.max() > spec.max_seq_length:
        raise ValueError(f"a row has {lengths.max()} tokens but max_seq_length is {spec.max_seq_length}: "
                         "shards of another sequence length?")
    m = spec.pad_to_multiple_of
    T = round_up(lengths.max(), m)
    positions = np.arange(T)[None, :]  # [1, T]
    real = positions < lengths[:, None]  # [B, T]
    input_ids = np.full(real.shape, spec.pad_id, dtype=np.int64)
    input_ids[real] = np.concatenate(rows)  # row-major fill of the real slots
    b_start = np.asarray(batch["segment_b_start"], dtype=np.int64)[:, None]  # [B, 1]
    token_type_ids = ((positions >= b_start) & real).astype(np.int64)
    return {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": real.astype(np.int64),
            "next_sentence_label": np.asarray(batch["next_sentence_label"], dtype=np.int64)}


def _sort_used_first(chosen: np.ndarray) -> np.ndarray:
    """Each row's positions ascending, unused (-1) slots last."""
    big = np.iinfo(np.int64).max
    s = np.sort(np.where(chosen < 0, big, chosen), axis=1)
    return np.where(s == big, -1, s)


def _choose_tokens(candidates: np.ndarray, num_to_predict: np.ndarray, P: int,
                       rng: np.random.Generator) -> np.ndarray:
    """[B, P] distinct random candidate positions: each row's first num_to_predict[b] slots used, the rest -1.
    Vectorised: a random key per token, then the P smallest keys of each row."""
    keys = rng.random(candidates.shape)
    keys[~candidates] = 2.0  # non-candidates sort after every candidate
    order = np.argsort(keys, axis=1, kind="stable")[:, :P]  # [B, min(T, P)]
    if order.shape[1] < P:
        order = np.pad(order, ((0, 0), (0, P - order.shape[1])), constant_values=-1)
    return np.where(np.arange(P)[None, :] < num_to_predict[:, None], order, -1)


def _choose_words(ids: np.ndarray, candidates: np.ndarray, num_to_predict: np.ndarray, P: int,
                  continuation: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Whole-word masking: a "##" piece belongs to the word of the candidate before it. Words are taken in a
    random order while they fit into num_to_predict (a word that would overflow is skipped, as the original)."""
    out = np.full((ids.shape[0], P), -1, dtype=np.int64)
    for b in range(ids.shape[0]):
        words: list[list[int]] = []
        for i in np.flatnonzero(candidates[b]):
            if words and continuation[ids[b, i]] and words[-1][-1] == i - 1:
                words[-1].append(int(i))
            else:
                words.append([int(i)])
        picked: list[int] = []
        for w in rng.permutation(len(words)):
            if len(picked) + len(words[w]) <= num_to_predict[b]:
                picked.extend(words[w])
            if len(picked) == num_to_predict[b]:
                break
        picked.sort()
        out[b, : len(picked)] = picked
    return out


def mask_batch(batch: dict[str, Any], spec: MaskingSpec, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """Shard rows → the BertForPreTraining inputs, as int64 tensors:
    input_ids, token_type_ids, attention_mask [B, T]; masked_positions, masked_lm_labels [B, P]
    (P = max_predictions; unused slots position 0, label -100); next_sentence_label [B]."""
    out = pad_batch(batch, spec)
    ids = out["input_ids"]  # [B, T]
    candidates = (out["attention_mask"] == 1) & ~np.isin(ids, spec.special_ids)  # [B, T]
    num_candidates = candidates.sum(axis=1)
    num_to_predict = np.minimum(spec.max_predictions,
                                np.maximum(1, np.rint(num_candidates * spec.masked_lm_prob).astype(np.int64)))
    num_to_predict = np.where(num_candidates > 0, num_to_predict, 0)  # [B]
    P = spec.max_predictions
    if spec.continuation is None:
        positions = _sort_used_first(_choose_tokens(candidates, num_to_predict, P, rng))
    else:
        positions = _choose_words(ids, candidates, num_to_predict, P, spec.continuation, rng)
    used = positions >= 0  # [B, P]
    pos = np.where(used, positions, 0)
    rows = np.arange(ids.shape[0])[:, None]
    labels = np.where(used, ids[rows, pos], IGNORE_INDEX)  # [B, P]
    # 80% [MASK], 10% random token, 10% unchanged.
    draw = rng.random(pos.shape)
    random_tokens = rng.choice(spec.replacement_ids(), size=pos.shape)
    new = np.where(draw < 0.8, spec.mask_id, np.where(draw < 0.9, labels, random_tokens))
    b_idx, p_idx = np.nonzero(used)
    ids[b_idx, pos[b_idx, p_idx]] = new[b_idx, p_idx]
    out["masked_positions"] = pos
    out["masked_lm_labels"] = labels
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}
