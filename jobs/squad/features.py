"""SQuAD examples -> model inputs as BERT builds them: [CLS] question [SEP] context window [SEP].

The question is cut to `max_query_length` WordPieces; the context is tokenized once with the fast tokenizer's
character offsets and cut into windows of what is left of `max_seq_length`, each starting `doc_stride` tokens
after the previous one. Every context token keeps its (start, end) characters in the original context, so a
predicted span maps back to the exact original text by slicing (no detokenising). A training window is
labelled with the answer's first and last token when it holds the whole answer, else with [CLS] (position 0),
which is also the label of an unanswerable question. A token seen by several windows counts only in the
window where it has the most context on both sides (the original run_squad rule), so the n-best search scores
it once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bertpipe.jobs.squad.data import Example


@dataclass
class Features:
    """One row per window; parallel lists."""

    input_ids: list[list[int]] = field(default_factory=list)
    token_type_ids: list[list[int]] = field(default_factory=list)
    example_index: list[int] = field(default_factory=list)
    # Per token: character start/end in the context, -1 for [CLS], question and [SEP] tokens.
    char_start: list[np.ndarray] = field(default_factory=list)
    char_end: list[np.ndarray] = field(default_factory=list)
    max_context: list[np.ndarray] = field(default_factory=list)  # bool per token
    start_positions: list[int] = field(default_factory=list)
    end_positions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)


def windows(num_tokens: int, max_tokens: int, stride: int) -> list[tuple[int, int]]:
    """(start, length) of each context window; the last one reaches the end of the context."""
    out, start = [], 0
    while True:
        length = min(num_tokens - start, max_tokens)
        out.append((start, length))
        if start + length >= num_tokens:
            return out
        start += min(length, stride)


def max_context_flags(spans: list[tuple[int, int]]) -> list[np.ndarray]:
    """Per window, per context token: is this the window where the token has the most context around it?
    Score = min(left, right) context + 1% of the window length (ties go to the longer window, then the first)."""
    best: dict[int, tuple[float, int]] = {}
    for w, (start, length) in enumerate(spans):
        for pos in range(start, start + length):
            score = min(pos - start, start + length - 1 - pos) + 0.01 * length
            if pos not in best or score > best[pos][0]:
                best[pos] = (score, w)
    return [np.array([best[p][1] == w for p in range(s, s + n)], dtype=bool) for w, (s, n) in enumerate(spans)]


def answer_tokens(starts: np.ndarray, ends: np.ndarray, char_start: int, char_end: int) -> tuple[int, int]:
    """First and last context token overlapping the answer's characters [char_start, char_end)."""
    first = int(np.searchsorted(ends, char_start, side="right"))
    last = int(np.searchsorted(starts, char_end, side="left")) - 1
    return first, max(first, last)


def build_features(tok, examples: list[Example], max_seq_length: int, doc_stride: int, max_query_length: int,
                   labelled: bool) -> Features:
    """Windows of every example; with `labelled`, start/end labels from the first reference answer."""
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    contexts = sorted({e.context for e in examples})
    encoded = dict(zip(contexts, tok.encode_batch(contexts, add_special_tokens=False)))
    questions = tok.encode_batch([e.question for e in examples], add_special_tokens=False)
    out = Features()
    for i, (ex, q) in enumerate(zip(examples, questions)):
        q_ids = q.ids[:max_query_length]
        ctx = encoded[ex.context]
        starts = np.array([o[0] for o in ctx.offsets], dtype=np.int64)
        ends = np.array([o[1] for o in ctx.offsets], dtype=np.int64)
        spans = windows(len(ctx.ids), max_seq_length - len(q_ids) - 3, doc_stride)
        target = None
        if labelled and ex.answers and not ex.is_impossible:
            target = answer_tokens(starts, ends, ex.answers[0].start, ex.answers[0].end)
        base = len(q_ids) + 2  # position of the window's first context token
        for (start, length), flags in zip(spans, max_context_flags(spans)):
            none = np.full(base, -1, dtype=np.int64)
            out.input_ids.append([cls_id, *q_ids, sep_id, *ctx.ids[start:start + length], sep_id])
            out.token_type_ids.append([0] * base + [1] * (length + 1))
            out.example_index.append(i)
            out.char_start.append(np.concatenate([none, starts[start:start + length], [-1]]))
            out.char_end.append(np.concatenate([none, ends[start:start + length], [-1]]))
            out.max_context.append(np.concatenate([np.zeros(base, bool), flags, [False]]))
            inside = target is not None and start <= target[0] and target[1] < start + length
            out.start_positions.append(base + target[0] - start if inside else 0)
            out.end_positions.append(base + target[1] - start if inside else 0)
    return out
