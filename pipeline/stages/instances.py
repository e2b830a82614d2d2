"""Document-level NSP instances, the google-research/bert `create_pretraining_data.py` algorithm (pure, no Ray).

What is the same as the original, decision for decision and random draw for random draw:
- target length = max_seq_length - 3 ([CLS], [SEP], [SEP]); with probability `short_seq_prob` a short target
  uniform in [2, max_num_tokens], drawn once per document per pass, so the model also sees short sequences;
- sentences are packed into a chunk until the target is reached; A = the first `a_end` sentences of the chunk
  (`a_end` uniform in [1, len(chunk) - 1]); B = the rest of the chunk (IsNext) or, with probability 1/2 and always
  for one-sentence chunks, a span from a random other document (NotNext), whose unused sentences are put back;
- `truncate_seq_pair` trims the longer side one token at a time, from the front or back at random;
- `dupe_factor` passes over the documents, then the instances are shuffled.

What differs:
- the random document is drawn from the *other* documents of the pool. The original makes ten tries to avoid the
  current document and labels the pair NotNext even when all ten hit it (the quirk NVIDIA's LDDL fixes);
  with a one-document pool a one-sentence chunk is skipped and longer chunks are always IsNext (counted);
- the pool is the block of documents the pipeline hands us (`pairs.docs_per_partition` neighbours in the corpus),
  not the whole corpus, so memory stays bounded whatever the corpus size (LDDL draws from its partition too);
  the instances are mixed across the corpus afterwards, when the pairs stage deals them into shards;
- nothing is materialised per instance: A and B are spans of one flat token array, the output is gathered with one
  vectorised numpy call, and token strings never exist. Masking is dynamic, at load time, not here.
"""
from __future__ import annotations

import bisect
import hashlib
import random
from array import array
from dataclasses import dataclass

import numpy as np
import pyarrow as pa


def derive_seed(*parts: object) -> int:
    """A 64-bit seed from (seed, stage, length, partition, pass...): stable across processes and Python versions."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


@dataclass
class PairStats:
    num_instances: int = 0
    num_random_next: int = 0
    num_doc_passes: int = 0
    num_short_targets: int = 0
    num_tokens: int = 0
    # Chunks dropped or forced IsNext because the pool had no other document (one-document partitions only).
    num_no_other_document: int = 0

    def add(self, other: "PairStats") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


SPAN_FIELDS = ("a_lo", "a_hi", "b_lo", "b_hi", "is_random", "a_doc", "b_doc")


class Spans:
    """Instances as token spans into one flat array: A = flat[a_lo:a_hi], B = flat[b_lo:b_hi], and the document
    index of A and of B (kept for tests and checks, not written to shards).

    Appended to one flat array('q') of seven values per instance: 56 bytes an instance, where seven lists of Python
    ints took ~250 (a pool of 2,000 Wikipedia articles makes a million instances at seq 128). `finish` orders them
    once; the fields are then columns of one (n, 7) int64 array.
    """

    def __init__(self, rows: np.ndarray | None = None):
        self._building = array("q")
        self._rows = rows

    def add(self, *values: int) -> None:
        """Append one instance: a_lo, a_hi, b_lo, b_hi, is_random, a_doc, b_doc."""
        self._building.extend(values)

    def finish(self, order: np.ndarray | None = None) -> "Spans":
        """Stop appending; the instances in `order` (a permutation of their indices) when given."""
        if self._rows is None:
            rows = np.frombuffer(self._building, np.int64).reshape(-1, len(SPAN_FIELDS)) if self._building else \
                np.zeros((0, len(SPAN_FIELDS)), np.int64)
            self._rows = rows[order] if order is not None else rows.copy()
            self._building = array("q")
        return self

    @property
    def rows(self) -> np.ndarray:
        return self.finish()._rows

    def __len__(self) -> int:
        return len(self.rows)

    def slice(self, lo: int, hi: int) -> "Spans":
        """Instances lo..hi-1 (a view)."""
        return Spans(self.rows[lo:hi])

    a_lo = property(lambda self: self.rows[:, 0])
    a_hi = property(lambda self: self.rows[:, 1])
    b_lo = property(lambda self: self.rows[:, 2])
    b_hi = property(lambda self: self.rows[:, 3])
    is_random = property(lambda self: self.rows[:, 4])
    a_doc = property(lambda self: self.rows[:, 5])
    b_doc = property(lambda self: self.rows[:, 6])


def _randint(rng: random.Random, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi]; random.randint's rejection sampling costs 10x more and buys nothing here."""
    return lo + int(rng.random() * (hi - lo + 1))


def _truncate_pair(a_lo, a_hi, b_lo, b_hi, max_num_tokens, rng):
    """`truncate_seq_pair` on spans, in O(1): trim the longer side (B on ties) one token at a time, each token from
    the front or the back with probability 1/2.

    Which side loses how many tokens does not depend on the coin flips (trim the longer down to the shorter, then
    alternate B, A, B...), so only the front/back split is random: Binomial(n, 1/2), drawn exactly as the popcount
    of n random bits instead of n calls to rng.random().
    """
    len_a, len_b = a_hi - a_lo, b_hi - b_lo
    excess = len_a + len_b - max_num_tokens
    if excess <= 0:
        return a_lo, a_hi, b_lo, b_hi
    gap = min(excess, abs(len_a - len_b))
    rest = excess - gap
    cut_a = (gap if len_a > len_b else 0) + rest // 2
    cut_b = (gap if len_b > len_a else 0) + rest - rest // 2
    if cut_a:
        front = bin(rng.getrandbits(cut_a)).count("1")
        a_lo, a_hi = a_lo + front, a_hi - (cut_a - front)
    if cut_b:
        front = bin(rng.getrandbits(cut_b)).count("1")
        b_lo, b_hi = b_lo + front, b_hi - (cut_b - front)
    assert a_hi > a_lo and b_hi > b_lo, "truncation emptied a segment"
    return a_lo, a_hi, b_lo, b_hi


def instances_from_document(
    doc_index: int,
    bounds: list[list[int]],
    max_seq_length: int,
    short_seq_prob: float,
    rng: random.Random,
    out: Spans,
    stats: PairStats,
) -> None:
    """Append one pass's instances of document `doc_index` to `out`.

    bounds[d] = sentence boundaries of document d in the flat token array: sentence k is flat[b[k]:b[k+1]]
    (len(b) = num_sentences + 1, every sentence non-empty).
    """
    doc = bounds[doc_index]
    num_docs = len(bounds)
    num_sentences = len(doc) - 1
    max_num_tokens = max_seq_length - 3
    # Usually fill the whole sequence (padding is wasted compute), sometimes not, so short inputs at fine-tuning
    # time are not out of distribution.
    target_seq_length = max_num_tokens
    stats.num_doc_passes += 1
    if rng.random() < short_seq_prob:
        target_seq_length = _randint(rng, 2, max_num_tokens)
        stats.num_short_targets += 1

    chunk_start = 0  # current chunk = sentences chunk_start..i
    while chunk_start < num_sentences:
        # The original adds one sentence at a time until the chunk reaches the target or the document ends;
        # jump straight to that sentence.
        i = min(bisect.bisect_left(doc, doc[chunk_start] + target_seq_length, chunk_start + 1), num_sentences) - 1
        num_chunk = i + 1 - chunk_start
        a_end = _randint(rng, 1, num_chunk - 1) if num_chunk >= 2 else 1
        a_lo, a_hi = doc[chunk_start], doc[chunk_start + a_end]
        random_next = num_chunk == 1 or rng.random() < 0.5
        if random_next and num_docs < 2:
            stats.num_no_other_document += 1
            random_next = False
            if num_chunk == 1:
                chunk_start = i + 1
                continue
        if random_next:
            b_doc, b_lo, b_hi = _random_b(bounds, doc_index, target_seq_length - (a_hi - a_lo), rng)
            # The sentences of the chunk after A were not used: put them back for the next chunk.
            i -= num_chunk - a_end
        else:
            b_doc = doc_index
            b_lo, b_hi = a_hi, doc[i + 1]
        a_lo, a_hi, b_lo, b_hi = _truncate_pair(a_lo, a_hi, b_lo, b_hi, max_num_tokens, rng)
        out.add(a_lo, a_hi, b_lo, b_hi, int(random_next), doc_index, b_doc)
        stats.num_instances += 1
        stats.num_random_next += int(random_next)
        chunk_start = i + 1


def _random_b(bounds: list[list[int]], doc_index: int, target_b_length: int,
              rng: random.Random) -> tuple[int, int, int]:
    """(document, first token, end token) of a NotNext B segment: sentences from a random *other* document.

    The original retries ten times to avoid doc_index and keeps the NotNext label even if it failed; drawing
    from the other documents directly is always right."""
    r = _randint(rng, 0, len(bounds) - 2)
    b_doc = r + 1 if r >= doc_index else r
    rdoc = bounds[b_doc]
    random_start = _randint(rng, 0, len(rdoc) - 2)
    b_lo = rdoc[random_start]
    # First sentence end at which B reaches target_b_length (or the document's end).
    k = bisect.bisect_left(rdoc, b_lo + target_b_length, random_start + 1)
    return b_doc, b_lo, rdoc[min(k, len(rdoc) - 1)]


def create_spans(
    bounds: list[list[int]],
    *,
    max_seq_length: int,
    short_seq_prob: float,
    dupe_factor: int,
    seed_parts: tuple,
) -> tuple[Spans, PairStats]:
    """All passes over a pool of documents, then a seeded shuffle. One generator per pass: (seed_parts, pass)."""
    if max_seq_length < 5:
        raise ValueError(f"max_seq_length={max_seq_length} leaves no room for A and B beside [CLS] [SEP] [SEP]")
    spans, stats = Spans(), PairStats()
    for pass_index in range(dupe_factor):
        rng = random.Random(derive_seed(*seed_parts, "pass", pass_index))
        for doc_index in range(len(bounds)):
            instances_from_document(doc_index, bounds, max_seq_length, short_seq_prob, rng, spans, stats)
    # numpy's permutation: ~50x faster than random.shuffle over a list of a million indices.
    order = np.random.default_rng(derive_seed(*seed_parts, "shuffle")).permutation(stats.num_instances)
    return spans.finish(order), stats


def token_pool(flat: np.ndarray, cls_id: int, sep_id: int, id_type: pa.DataType) -> np.ndarray:
    """The pool `gather_from_pool` reads: the pool's tokens in the shard's id type, then [CLS] and [SEP]."""
    np_type = np.uint16 if id_type == pa.uint16() else np.int32
    return np.concatenate([flat.astype(np_type, copy=False), np.array([cls_id, sep_id], dtype=np_type)])


def gather_instances(flat: np.ndarray, spans: Spans, cls_id: int, sep_id: int, id_type: pa.DataType) -> pa.Table:
    """The shard columns for `spans`: input_ids = [CLS] A [SEP] B [SEP], segment_b_start, label, num_tokens."""
    return gather_from_pool(token_pool(flat, cls_id, sep_id, id_type), spans, id_type)


def gather_from_pool(pool: np.ndarray, spans: Spans, id_type: pa.DataType) -> pa.Table:
    """`gather_instances` from a `token_pool`, which a caller gathering a pool's instances a slice at a time builds
    once. One vectorised gather: every instance is five ranges of the pool."""
    n = len(spans)
    cls_at, sep_at = len(pool) - 2, len(pool) - 1
    a_lo, a_hi = np.asarray(spans.a_lo, np.int64), np.asarray(spans.a_hi, np.int64)
    b_lo, b_hi = np.asarray(spans.b_lo, np.int64), np.asarray(spans.b_hi, np.int64)
    starts = np.empty((n, 5), np.int64)
    lengths = np.ones((n, 5), np.int64)
    starts[:, 0], starts[:, 2], starts[:, 4] = cls_at, sep_at, sep_at
    starts[:, 1], lengths[:, 1] = a_lo, a_hi - a_lo
    starts[:, 3], lengths[:, 3] = b_lo, b_hi - b_lo
    starts, lengths = starts.ravel(), lengths.ravel()
    total = int(lengths.sum())
    # index of output token t: consecutive within a range, so the index is a running sum of ones with, at each
    # range's first position, the jump from the previous range's last source token (one cumsum: ~2x faster than
    # arange + repeat). int32 when it fits: half the memory traffic. Every range has a token (A and B are never
    # empty), so no two ranges start at one position.
    index_type = np.int32 if len(pool) + total < 2**31 else np.int64
    index = np.ones(total, index_type)
    if n:
        jumps = starts.copy()
        jumps[1:] -= starts[:-1] + lengths[:-1] - 1
        index[np.cumsum(lengths) - lengths] = jumps
        np.cumsum(index, out=index)
    num_tokens = (a_hi - a_lo) + (b_hi - b_lo) + 3
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(num_tokens, out=offsets[1:])
    input_ids = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(pool[index], id_type))
    return pa.table({
        "input_ids": input_ids,
        "segment_b_start": pa.array((a_hi - a_lo + 2).astype(np.int16), pa.int16()),
        "next_sentence_label": pa.array(np.asarray(spans.is_random, np.int8), pa.int8()),
        "num_tokens": pa.array(num_tokens.astype(np.int16), pa.int16()),
    })
