"""Length binning: regroup a stream of micro-batches so that rows of similar length share a batch.

A micro-batch is padded to its longest row, so one long row makes every short row in its batch cost the full
length. `create_pretraining_data` instances are mostly near max_seq_length (90% of targets are the full length)
but the rest — short targets, document ends — are not, and a random batch of 16 almost always holds a long row.
Binning reads `window` micro-batches, sorts their rows by length, cuts them back into `window` micro-batches of
the same size and yields those in a seeded random order: every row is used exactly once per epoch, batch sizes
do not change, and only which rows share a batch does. `benchmarks/bench_length_binning.py` measures the padding
and the step time it saves on real shards.

The regrouping is a pure function of the input order and the generator, so a resumed run that skips the first
k output batches of an epoch sees exactly the batches an uninterrupted run would have.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np

from bertpipe.model.training import round_up


def row_lengths(batch: dict[str, Any]) -> np.ndarray:
    """[B] token count of each row (Ray hands list columns over as an object array, or 2-D if rows are equal)."""
    if "num_tokens" in batch:
        return np.asarray(batch["num_tokens"], dtype=np.int64)
    return np.array([len(r) for r in batch["input_ids"]], dtype=np.int64)


def as_rows(column: Any) -> np.ndarray:
    """A column as a 1-D array with one entry per row (a 2-D list column becomes an object array of rows), so
    columns of different batches concatenate whatever shape Ray gave each."""
    a = np.asarray(column)
    if a.ndim == 1:
        return a
    out = np.empty(a.shape[0], dtype=object)
    out[:] = list(a)
    return out


def concat_rows(batches: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([as_rows(b[k]) for b in batches]) for k in batches[0]}


def length_binned(batches: Iterable[dict[str, Any]], window: int,
                  rng: np.random.Generator) -> Iterator[dict[str, Any]]:
    """Yield the rows of `batches` regrouped by length, `window` batches at a time (see the module docstring).
    window == 1 passes batches through untouched. A last window with fewer batches is regrouped all the same."""
    if window < 1:
        raise ValueError(f"length-binning window must be >= 1, got {window}")
    if window == 1:
        yield from batches
        return
    pending: list[dict[str, Any]] = []
    for batch in batches:
        pending.append(batch)
        if len(pending) == window:
            yield from _regroup(pending, rng)
            pending = []
    if pending:
        yield from _regroup(pending, rng)


def _regroup(batches: list[dict[str, Any]], rng: np.random.Generator) -> Iterator[dict[str, Any]]:
    sizes = [len(row_lengths(b)) for b in batches]
    merged = concat_rows(batches)
    order = np.argsort(row_lengths(merged), kind="stable")  # shortest first
    bounds = np.cumsum([0, *sorted(sizes)])
    groups = [order[bounds[i]:bounds[i + 1]] for i in range(len(sizes))]
    for g in rng.permutation(len(groups)):  # batch order random, so length does not trend within the window
        rows = np.sort(groups[g])  # shard order kept inside a batch
        yield {k: v[rows] for k, v in merged.items()}


def padding_fraction(lengths: np.ndarray, batch_size: int, multiple: int = 8) -> float:
    """Share of the padded [B, T] slots that are padding when `lengths` are cut into batches in this order and
    each batch is padded to its longest row rounded up to `multiple`."""
    padded = 0
    for start in range(0, len(lengths), batch_size):
        chunk = lengths[start:start + batch_size]
        padded += len(chunk) * round_up(chunk.max(), multiple)
    return 1.0 - float(lengths.sum()) / padded if padded else 0.0
