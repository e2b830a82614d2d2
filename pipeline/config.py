"""Typed configs of the data stages. Frozen, keyword-only: YAML and `--set key=value` fill them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The real Wikipedia sample that `bertpipe fetch-sample` (run by `make run`) extracts from the gensim 4.4.0 wheel.
SAMPLE_DUMP = "data/sample/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def path_field(default: Any = "") -> Any:
    """A field naming a local path or URI (or a tuple of them). The config loader makes every such field absolute
    on the driver (`jobs.configtools.resolve_paths`): code on a Ray worker never sees a relative path."""
    return field(default=default, metadata={"path": True})


@dataclass(frozen=True, kw_only=True)
class CleanConfig:
    # One or more dumps: local paths, globs or any smart_open URI (s3://, gs://, https://).
    input: tuple[str, ...] = path_field((SAMPLE_DUMP,))
    # Paragraphs shorter than this (after markup removal) are dropped: leftovers of captions and stubs.
    min_paragraph_chars: int = 20
    # Articles with less text than this are dropped (stubs carry no sentence pairs worth training on).
    min_article_chars: int = 200
    skip_disambiguation: bool = True
    # A page's wikitext above this many bytes is cut (and counted), so one pathological page cannot blow a worker.
    max_page_bytes: int = 4_000_000
    # Pages per Ray Data block handed to the parser.
    pages_per_batch: int = 64
    # Most read tasks running at once (one per dump or per byte range); 0 = as many as Ray's CPUs allow.
    num_read_workers: int = 0
    # Multistream dumps (with their -index.txt[.bz2] beside them) are split into ranges of whole bz2 streams of
    # about this many compressed bytes, so one big file is read by several workers.
    split_bytes: int = 128 * 1024 * 1024
    # Documents per output Parquet file.
    rows_per_file: int = 20_000


@dataclass(frozen=True, kw_only=True)
class VocabConfig:
    # An existing vocab.txt (Google's uncased vocabulary works); empty = train one on the clean corpus.
    path: str = path_field()
    # Documents to train on instead of the clean stage's output: a folder of Parquet files with a `text` column
    # (a clean output), or text files / a folder of them (one sentence per line, a blank line between documents,
    # the format of google-research/bert). Empty = the clean stage's output.
    input: str = path_field()
    vocab_size: int = 30_522
    lowercase: bool = True
    min_frequency: int = 2
    limit_alphabet: int = 1_000
    # The trainer reads at most this much text, drawn at random (seeded) across the whole corpus in pieces of
    # one Parquet row group (1,000 documents) or one text file, so its time and memory stop growing with the
    # corpus. 0 = the whole corpus.
    max_sample_bytes: int = 300_000_000


@dataclass(frozen=True, kw_only=True)
class PairsConfig:
    # Documents to pair instead of the clean stage's output (same forms as vocab.input). The vocabulary comes
    # from vocab.path when set, else from the vocab stage.
    input: str = path_field()
    # One shard set per length: phase 1 trains at 128, phase 2 at 512 (BERT paper).
    max_seq_lengths: tuple[int, ...] = (128, 512)
    short_seq_prob: float = 0.1
    dupe_factor: int = 10
    # Shards per sequence length; every shard gets the same number of rows so N workers get equal work.
    num_shards: int = 8
    # Fraction of documents kept out of training for the held-out MLM/NSP evaluation.
    heldout_fraction: float = 0.02
    # Documents per pairing pool (one task of the first pass): the NotNext B is drawn from the other documents of
    # the pool, and one pool's tokens and instances are what a task holds in memory.
    docs_per_partition: int = 2_000
