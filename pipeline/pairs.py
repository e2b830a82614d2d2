"""The `pairs` stage: clean documents -> sentences -> WordPiece ids -> NSP instances -> equal-row Parquet shards.

Pure core (testable without Ray): `encode_documents` (split + batched Rust tokenization) and `pair_table`
(instances of one pool of documents). Ray wrapper: read -> tokenize (map_batches) -> hold out by doc-id hash ->
random_shuffle(seed) so each pairing partition is a random sample of the corpus -> pair per max_seq_length ->
split into `num_shards` equal slices (remainder dropped and counted) -> one writer task per shard.

Why tokenization is not one `encode` per sentence: per batch of documents, printable-ASCII sentences skip the
Unicode normalizer and are pre-tokenized by one regex, and each distinct word goes through Rust WordPiece once
(see `encode_documents`); same ids, ~2x faster than `encode_batch` over the sentences.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import re
import time

import numpy as np
import pyarrow as pa

from bertpipe.pipeline import shards, storage
from bertpipe.pipeline.config import PairsConfig, VocabConfig
from bertpipe.pipeline.instances import PairStats, create_spans, derive_seed, gather_instances
from bertpipe.pipeline.sentences import split_sentences
from bertpipe.pipeline.stage import StageContext, StageInputError, StageResult
from bertpipe.pipeline.documents import document_files, read_documents
from bertpipe.pipeline.progress import Reporter, remote_progress
from bertpipe.pipeline.vocab import load_vocab, make_tokenizer, special_ids, vocab_file, vocab_hash

log = logging.getLogger(__name__)

TOKENIZED_SCHEMA = pa.schema([("id", pa.int64()), ("tokens", pa.list_(pa.int32())), ("bounds", pa.list_(pa.int32()))])
# Per-batch counters carried on the first row of each pairing batch (0 elsewhere), summed by the driver.
STAT_COLUMNS = ("_doc_passes", "_short_targets", "_no_other_document")


# ----------------------------------------------------------------------------------------------- pure core


@functools.lru_cache(maxsize=4)
def cached_tokenizers(vocab_uri: str, lowercase: bool):
    """(full tokenizer, normalizer-free twin) per worker process; the vocabulary is read once per process."""
    full = make_tokenizer(vocab_uri, lowercase)
    fast = make_tokenizer(vocab_uri, lowercase)
    fast.normalizer = None
    return full, fast


# BertPreTokenizer on printable ASCII: runs of letters/digits are words, every other non-space character is a word
# of its own (ASCII symbols count as punctuation). "\n" (never inside a plain sentence) marks sentence ends.
_PLAIN_WORD = re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9 \n]|\n")
# Any other sentence, once its ASCII control characters are deleted (the normalizer deletes them too): pieces that
# the BERT normalizer and pre-tokenizer treat independently, because both work character by character and split at
# ASCII whitespace and punctuation. A run with non-ASCII characters still needs both (accents, CJK, Unicode
# punctuation and spaces inside it); a run of ASCII letters/digits is one word; ASCII punctuation is one word.
_RUN = re.compile(r"(?:[A-Za-z0-9]|[^\x00-\x7f])+|[!-/:-@\[-`{-~]")
_DELETE_ASCII_CONTROLS = dict.fromkeys([*range(0, 9), 11, 12, *range(14, 32), 127])


def _normalize_runs(runs: list[str], full) -> dict[str, list[str]]:
    """Distinct non-ASCII runs -> their words after the BERT normalizer and pre-tokenizer, in one call of each.

    The runs are joined with " | ": "|" is a word of its own and no run contains it or normalizes to it (checked by
    the count; on a mismatch each run is processed on its own).
    """
    normalize, pre_tokenize = full.normalizer.normalize_str, full.pre_tokenizer.pre_tokenize_str
    out: list[list[str]] = [[]]
    for w, _ in pre_tokenize(normalize(" | ".join(runs))):
        if w == "|":
            out.append([])
        else:
            out[-1].append(w)
    if len(out) != len(runs):
        out = [[w for w, _ in pre_tokenize(normalize(r))] for r in runs]
    return dict(zip(runs, out))


def _gather_ranges(pool: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """pool[starts[0]:starts[0]+lengths[0]] + pool[starts[1]:...] + ..., in one vectorised gather."""
    ends = np.cumsum(lengths)
    index = np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)
    return pool[index]


def _encode_words(words: list[str], fast) -> tuple[np.ndarray, np.ndarray]:
    """(flat ids, ids per sentence) of a stream of normalized words where "\n" ends each sentence.

    WordPiece works word by word, so a sentence's ids are its words' ids in order. Wikipedia text is Zipfian: a
    batch of documents has ~15x fewer distinct words than words, so each distinct word is tokenized once, all of
    them in one pre-tokenized `encode` call, and the sentences are gathered from those pieces with numpy.
    """
    index = {w: i for i, w in enumerate(dict.fromkeys(words))}
    enc = fast.encode(list(index), is_pretokenized=True, add_special_tokens=False)
    pool = np.array(enc.ids, np.int32)
    piece_len = np.bincount(np.array(enc.word_ids, np.int64), minlength=len(index))  # "\n" -> 0 ids
    occ = np.fromiter(map(index.__getitem__, words), np.int64, len(words))
    occ_len = piece_len[occ]
    flat = _gather_ranges(pool, (np.cumsum(piece_len) - piece_len)[occ], occ_len)
    sentence_ends = np.cumsum(occ_len)[occ == index["\n"]]
    return flat, np.diff(sentence_ends, prepend=0)


def encode_documents(texts: list[str], tokenizers_pair, lowercase: bool) -> tuple[np.ndarray, list[list[int]]]:
    """Split and tokenize documents: (flat int32 token ids, per document the sentence boundaries into it).

    Sentence k of document d is flat[bounds[d][k]:bounds[d][k + 1]]; sentences that tokenize to nothing are
    dropped, a document without tokens gets bounds [start] (no sentences). Same ids as `full.encode` per sentence
    (tested), ~2x faster than one `encode_batch` over the sentences:
    - the BERT normalizer (control-char cleanup, CJK spacing, NFD accent stripping, lowercasing) is the identity
      plus `str.lower` on printable ASCII, and BertPreTokenizer there is one regex (`_PLAIN_WORD`): those
      sentences (93% of English Wikipedia's) never enter the Rust pipeline whole;
    - in the other sentences only the distinct runs with non-ASCII characters go through the normalizer and the
      pre-tokenizer (`_RUN`, `_normalize_runs`), all in one call;
    - then `_encode_words`: each distinct word tokenized once.
    """
    full, fast = tokenizers_pair
    sentences = [split_sentences(t or "") for t in texts]
    # Pass 1: printable-ASCII sentences as they are, the others as runs (their non-ASCII runs collected).
    items: list[str | list[str]] = []
    non_ascii: dict[str, None] = {}
    for s in itertools.chain.from_iterable(sentences):
        if s.isascii() and s.isprintable():
            items.append(s)
        else:
            pieces = _RUN.findall(s.translate(_DELETE_ASCII_CONTROLS))
            non_ascii.update((p, None) for p in pieces if not p.isascii())
            items.append(pieces)
    normalized = _normalize_runs(list(non_ascii), full) if non_ascii else {}
    # Pass 2: the word stream, "\n" after each sentence; consecutive ASCII sentences share one regex call.
    words: list[str] = []
    run: list[str] = []
    for item in itertools.chain(items, [None]):  # None: the end, flushes the last run
        if isinstance(item, str):
            run.append(item)
            continue
        if run:
            text = "\n".join(run) + "\n"
            words.extend(_PLAIN_WORD.findall(text.lower() if lowercase else text))
            run.clear()
        if item is not None:
            for piece in item:
                if piece.isascii():
                    words.append(piece.lower() if lowercase else piece)
                else:
                    words.extend(normalized[piece])
            words.append("\n")
    flat, lengths = _encode_words(words, fast) if words else (np.zeros(0, np.int32), np.zeros(0, np.int64))
    ends, lengths = np.cumsum(lengths).tolist(), lengths.tolist()
    bounds, k = [], 0
    for doc_sents in sentences:
        b = [ends[k - 1] if k else 0]
        for j in range(k, k + len(doc_sents)):
            if lengths[j]:
                b.append(ends[j])
        k += len(doc_sents)
        bounds.append(b)
    return flat, bounds


def is_heldout(doc_id: int, fraction: float) -> bool:
    """Stable held-out membership from the document id alone (not the seed: the eval set must not move)."""
    h = int.from_bytes(hashlib.sha256(f"heldout:{doc_id}".encode()).digest()[:8], "little")
    return h < fraction * 2.0**64


def pair_table(flat: np.ndarray, bounds: list[list[int]], *, max_seq_length: int, short_seq_prob: float,
               dupe_factor: int, seed_parts: tuple, cls_id: int, sep_id: int,
               id_type: pa.DataType) -> tuple[pa.Table, PairStats]:
    """Instances (shard columns) of one pool of documents; documents without sentences are left out."""
    bounds = [b for b in bounds if len(b) > 1]
    spans, stats = create_spans(bounds, max_seq_length=max_seq_length, short_seq_prob=short_seq_prob,
                                dupe_factor=dupe_factor, seed_parts=seed_parts)
    table = gather_instances(flat, spans, cls_id, sep_id, id_type)
    stats.num_tokens = int(flat.size)
    return table, stats


# ----------------------------------------------------------------------------------- Ray Data map functions


def tokenize_batch(batch: pa.Table, *, vocab_uri: str, lowercase: bool, progress: Reporter | None = None) -> pa.Table:
    """map_batches: clean documents (id, text) -> (id, tokens, bounds) with per-document bounds from 0."""
    flat, bounds = encode_documents(batch.column("text").to_pylist(), cached_tokenizers(vocab_uri, lowercase), lowercase)
    if progress is not None:
        progress.add(batch.num_rows)
    doc_start = np.array([b[0] for b in bounds] + [flat.size], dtype=np.int32)
    local_bounds = [[x - b[0] for x in b] for b in bounds]
    return pa.table({
        "id": batch.column("id").cast(pa.int64()),
        "tokens": pa.ListArray.from_arrays(pa.array(doc_start), pa.array(flat, pa.int32())),
        "bounds": pa.array(local_bounds, pa.list_(pa.int32())),
    }, schema=TOKENIZED_SCHEMA)


def select_heldout(batch: pa.Table, *, fraction: float, heldout: bool) -> pa.Table:
    mask = [is_heldout(i, fraction) == heldout for i in batch.column("id").to_pylist()]
    return batch.filter(pa.array(mask, pa.bool_()))


def pair_batch(batch: pa.Table, *, seed: int, max_seq_length: int, short_seq_prob: float, dupe_factor: int,
               cls_id: int, sep_id: int, vocab_size: int, progress: Reporter | None = None) -> pa.Table:
    """map_batches: a pool of tokenized documents -> instances (+ per-batch counters in STAT_COLUMNS)."""
    if progress is not None:
        progress.add(batch.num_rows)
    tokens = batch.column("tokens").combine_chunks()
    flat = tokens.values.to_numpy(zero_copy_only=False)
    starts = tokens.offsets.to_numpy()[:-1] - tokens.offsets[0].as_py()
    bounds = [[x + int(s) for x in b] for s, b in zip(starts, batch.column("bounds").to_pylist())]
    ids = batch.column("id").to_pylist()
    # The partition's identity comes from its content (Ray Data does not tell a batch its index): deterministic
    # as long as the shuffle is.
    key = hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:16]
    table, stats = pair_table(flat, bounds, max_seq_length=max_seq_length, short_seq_prob=short_seq_prob,
                              dupe_factor=dupe_factor, seed_parts=(seed, "pairs", max_seq_length, key),
                              cls_id=cls_id, sep_id=sep_id, id_type=shards.id_type(vocab_size))
    counters = (stats.num_doc_passes, stats.num_short_targets, stats.num_no_other_document)
    for name, value in zip(STAT_COLUMNS, counters):
        column = np.zeros(table.num_rows, np.int64)
        if table.num_rows:
            column[0] = value
        table = table.append_column(name, pa.array(column))
    return table


def _write_shard_task(uri: str, schema_bytes: bytes, *tables: pa.Table) -> int:
    """Ray task: concatenate the blocks of one shard, drop the counters, cast to the shard schema, write."""
    schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
    parts = [t.drop_columns([c for c in STAT_COLUMNS if c in t.column_names]).cast(schema) for t in tables if t.num_rows]
    table = pa.concat_tables(parts) if parts else schema.empty_table()
    shards.write_shard(uri, table.replace_schema_metadata(schema.metadata))
    return table.num_rows


# ------------------------------------------------------------------------------------------------ the stage


def _lowercase(ctx: StageContext) -> bool:
    """do_lower_case as the vocab stage recorded it (its manifest), else the vocab config, else BERT's default."""
    extra = (ctx.input("vocab").manifest or {}).get("extra", {})
    if "do_lower_case" in extra:
        return bool(extra["do_lower_case"])
    cfg = ctx.config.get("vocab")
    return cfg.lowercase if isinstance(cfg, VocabConfig) else True


def _write_length(ctx, cfg, train, heldout, length, meta, vocab_size, seed, pair_kwargs):
    """Pair, split into equal shards and write one max_seq_length; returns its metrics."""
    import ray

    kwargs = dict(pair_kwargs, max_seq_length=length)
    schema = shards.shard_schema(vocab_size, length, meta)
    schema_bytes = schema.serialize().to_pybytes()
    out_dir = storage.join(ctx.output_uri, shards.seq_dir(length))
    write = ray.remote(_write_shard_task)

    with remote_progress(f"pairs seq {length}", train.count(), "docs") as progress:
        instances = train.map_batches(
            pair_batch, batch_size=cfg.docs_per_partition, batch_format="pyarrow",
            fn_kwargs=dict(kwargs, seed=seed, dupe_factor=cfg.dupe_factor, progress=progress))
        instances.set_name(f"pairs: instances seq {length}")
        instances = instances.materialize()
    total = instances.count()
    rows = total // cfg.num_shards
    if rows == 0:
        raise StageInputError(f"{ctx.input('clean').uri} yields {total} instances at max_seq_length={length}: "
                              f"too few for pairs.num_shards={cfg.num_shards}")
    parts = instances.split_at_indices([rows * k for k in range(1, cfg.num_shards + 1)])
    pending = [write.remote(storage.join(out_dir, shards.train_shard_name(k)), schema_bytes, *part.to_arrow_refs())
               for k, part in enumerate(parts[:cfg.num_shards])]
    # The held-out set is one pass (no dupes): it measures, it does not train.
    held = heldout.map_batches(pair_batch, batch_size=cfg.docs_per_partition, batch_format="pyarrow",
                               fn_kwargs=dict(kwargs, seed=seed + 1, dupe_factor=1)).materialize()
    pending.append(write.remote(storage.join(out_dir, shards.HELDOUT_NAME), schema_bytes, *held.to_arrow_refs()))
    written = ray.get(pending)
    assert all(n == rows for n in written[:-1]), f"unequal shards {written}"
    sums = {c: instances.sum(c) or 0 for c in STAT_COLUMNS} if total else dict.fromkeys(STAT_COLUMNS, 0)
    random_next = instances.sum("next_sentence_label") or 0
    tokens = instances.sum("num_tokens") or 0
    log.info("pairs: seq %d: %d instances (%.1f%% NotNext) -> %d shards x %d rows, %d dropped, %d held out",
             length, total, 100 * random_next / max(total, 1), cfg.num_shards, rows, total - rows * cfg.num_shards,
             written[-1])
    return {
        f"instances_seq{length}": total,
        f"instances_written_seq{length}": rows * cfg.num_shards,
        f"heldout_instances_seq{length}": written[-1],
        f"rows_dropped_for_equal_shards_seq{length}": total - rows * cfg.num_shards,
        f"nsp_random_fraction_seq{length}": random_next / max(total, 1),
        f"short_target_fraction_seq{length}": sums["_short_targets"] / max(sums["_doc_passes"], 1),
        f"no_other_document_chunks_seq{length}": sums["_no_other_document"],
        f"instance_tokens_seq{length}": tokens,
    }


def _tokenized_split(ctx: StageContext, cfg: PairsConfig, files: list[str], vocab_uri: str, lowercase: bool,
                     started: float):
    """(shuffled training documents, held-out documents, document count, token count), tokenized."""
    known = (ctx.input("clean").manifest or {}).get("num_rows")  # documents, when the clean stage made them
    with remote_progress("pairs tokenize", known, "docs") as progress:
        tokenized = read_documents(files).map_batches(
            tokenize_batch, batch_size=cfg.docs_per_tokenize_batch, batch_format="pyarrow",
            fn_kwargs={"vocab_uri": vocab_uri, "lowercase": lowercase, "progress": progress})
        tokenized.set_name("pairs: tokenize")  # what the Ray dashboard's Data page shows
        tokenized = tokenized.materialize()
    num_docs = tokenized.count()
    corpus_tokens = int(tokenized.map_batches(
        lambda b: pa.table({"n": [len(b.column("tokens").combine_chunks().values)]}), batch_format="pyarrow"
    ).sum("n") or 0)
    log.info("pairs: tokenized %d documents, %d tokens (%.0f tokens/s)", num_docs, corpus_tokens,
             corpus_tokens / max(time.time() - started, 1e-9))
    train = tokenized.map_batches(select_heldout, batch_format="pyarrow",
                                  fn_kwargs={"fraction": cfg.heldout_fraction, "heldout": False})
    heldout = tokenized.map_batches(select_heldout, batch_format="pyarrow",
                                    fn_kwargs={"fraction": cfg.heldout_fraction, "heldout": True}).materialize()
    # Shuffle documents across partitions: each pairing pool becomes a random sample of the corpus, so the
    # NotNext draw is close to the original's whole-corpus draw while memory stays one partition.
    train = train.random_shuffle(seed=derive_seed(ctx.seed, "pairs", "shuffle") % 2**32).materialize()
    log.info("pairs: %d training documents shuffled, %d held out", train.count(), heldout.count())
    return train, heldout, num_docs, corpus_tokens


def run_stage(ctx: StageContext) -> StageResult:
    from ray.data import DataContext

    cfg: PairsConfig = ctx.config["pairs"]
    started = time.time()
    vocab_uri = vocab_file(ctx.input("vocab").uri)
    tokens_list = load_vocab(vocab_uri)
    specials = special_ids(tokens_list)
    lowercase = _lowercase(ctx)
    files = document_files(ctx.input("clean").uri)
    v_hash = vocab_hash(vocab_uri)

    data_ctx = DataContext.get_current()
    saved_order = data_ctx.execution_options.preserve_order
    data_ctx.execution_options.preserve_order = True  # same seed -> same blocks in the same order -> same bytes
    try:
        train, heldout, num_docs, corpus_tokens = _tokenized_split(ctx, cfg, files, vocab_uri, lowercase, started)
        meta_common = dict(vocab_hash=v_hash, vocab_size=len(tokens_list), do_lower_case=lowercase,
                           special_ids=specials)
        pair_kwargs = dict(short_seq_prob=cfg.short_seq_prob, cls_id=specials["[CLS]"], sep_id=specials["[SEP]"],
                           vocab_size=len(tokens_list))
        metrics: dict[str, float] = {}
        for length in cfg.max_seq_lengths:
            meta = shards.shard_meta(max_seq_length=length, **meta_common)
            seed = derive_seed(ctx.seed, "pairs", length) % 2**31
            metrics.update(_write_length(ctx, cfg, train, heldout, length, meta, len(tokens_list), seed, pair_kwargs))
    finally:
        data_ctx.execution_options.preserve_order = saved_order

    seconds = time.time() - started
    first = cfg.max_seq_lengths[0]
    metrics.update({
        "documents": num_docs,
        "tokens": corpus_tokens,
        "tokens_per_second": corpus_tokens / max(seconds, 1e-9),
        "nsp_random_fraction": metrics[f"nsp_random_fraction_seq{first}"],
        "short_target_fraction": metrics[f"short_target_fraction_seq{first}"],
        "rows_dropped_for_equal_shards": sum(metrics[f"rows_dropped_for_equal_shards_seq{L}"] for L in cfg.max_seq_lengths),
        "seconds": round(seconds, 3),
    })
    metrics = {k: float(v) for k, v in metrics.items()}
    ctx.log_metrics(metrics, None)
    return StageResult(
        num_rows=int(sum(metrics[f"instances_written_seq{L}"] for L in cfg.max_seq_lengths)),
        metrics=metrics,
        extra={"vocab_hash": v_hash, "max_seq_lengths": list(cfg.max_seq_lengths), "num_shards": cfg.num_shards},
        outputs=[f"{shards.seq_dir(L)}/{name}" for L in cfg.max_seq_lengths
                 for name in [*map(shards.train_shard_name, range(cfg.num_shards)), shards.HELDOUT_NAME]],
    )
