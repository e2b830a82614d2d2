"""Typed configs of the data stages. Frozen, keyword-only: YAML and `--set key=value` fill them."""
from __future__ import annotations

from dataclasses import dataclass

from bertpipe.pipeline.framework.config_fields import MAX_SEQ_LENGTH, MIN_SEQ_LENGTH, at_least, path_field, within

# The real Wikipedia sample that `bertpipe fetch-sample` (run by `make run`) extracts from the gensim 4.4.0 wheel.
SAMPLE_DUMP = "data/sample/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


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

    def __post_init__(self) -> None:
        if not self.input or any(not uri for uri in self.input):
            raise ValueError(f"clean.input must name at least one dump and no empty path, got {list(self.input)}")
        at_least("clean", self, 0, "min_paragraph_chars", "min_article_chars", "num_read_workers")
        at_least("clean", self, 1, "max_page_bytes", "pages_per_batch", "split_bytes", "rows_per_file")


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

    def __post_init__(self) -> None:
        # 104: the special slots of Google's layout (pipeline/stages/vocab.py GOOGLE_SPECIAL_LAYOUT) plus one
        # learned piece.
        at_least("vocab", self, 105, "vocab_size")
        at_least("vocab", self, 0, "min_frequency", "max_sample_bytes")
        at_least("vocab", self, 1, "limit_alphabet")


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
    # The memory one task of the stage may hold, in bytes, whatever the corpus size and num_shards: a pool's text
    # beyond what fits is paired as several pools, and the shuffle that deals instances into shards works on pieces
    # that fit. Each task asks Ray for this much `memory`, so a node runs only as many at once as its memory holds.
    # The shards' bytes depend on it (the pieces of the shuffle), as they do on docs_per_partition.
    max_task_bytes: int = 2**30

    def __post_init__(self) -> None:
        lengths = self.max_seq_lengths
        if (not lengths or any(not MIN_SEQ_LENGTH <= n <= MAX_SEQ_LENGTH for n in lengths)
                or list(lengths) != sorted(set(lengths))):
            raise ValueError(f"pairs.max_seq_lengths must be distinct lengths in [{MIN_SEQ_LENGTH}, {MAX_SEQ_LENGTH}], "
                             f"ascending, got {list(lengths)}")
        within("pairs", self, "short_seq_prob", 0.0, 1.0)
        within("pairs", self, "heldout_fraction", 0.0, 1.0, high_open=True)
        at_least("pairs", self, 1, "dupe_factor", "num_shards", "docs_per_partition")
        # Below this a task's worker (Python, pyarrow, the tokenizer: ~300 MB) and one row group on its way out
        # leave too little room for data.
        at_least("pairs", self, 640 * 2**20, "max_task_bytes")
