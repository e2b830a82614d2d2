"""The `pairs` stage: clean documents -> sentences -> WordPiece ids -> NSP instances -> equal-row Parquet shards.

Pure core (testable without Ray): `encode_documents` (split + batched Rust tokenization) and `pair_table`
(instances of one pool of documents). Ray wrapper, two passes, streaming, memory bounded by one block or one
bucket whatever the corpus size:
1. one Ray Data job, `pair_block` per pool of `docs_per_partition` documents: tokenize once; hold out documents by
   id hash; for every max_seq_length pair the pool (NotNext B from another document of the same pool, as LDDL
   draws from its partition), shuffle, deal the instances into G buckets and write them as one part file (Arrow
   IPC) of G record batches (held-out instances as a part of their own). Only a row of counters per block comes back.
2. per length, one task per bucket reads that record batch of every part, shuffles it and writes num_shards / G
   shards of exactly the same row count (the smallest bucket sets it; the few extra rows are dropped and
   counted); one task concatenates the held-out parts. Then the part files are deleted.
Equal-row shards need every block's count first, so the instances are written twice: the only second pass.

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
import pyarrow.parquet as pq

from bertpipe.pipeline.formats import shards
from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.stages.config import PairsConfig, VocabConfig
from bertpipe.pipeline.stages.instances import PairStats, create_spans, derive_seed, gather_instances
from bertpipe.pipeline.stages.sentences import split_sentences
from bertpipe.pipeline.framework.stage import StageContext, StageInputError, StageResult
from bertpipe.pipeline.stages.documents import document_files, read_documents
from bertpipe.pipeline.framework.progress import Reporter
from bertpipe.pipeline.formats.tokenizer import SPECIAL_TOKENS
from bertpipe.pipeline.formats.vocabulary import load_vocab, make_tokenizer, special_ids, vocab_file, vocab_hash

log = logging.getLogger(__name__)



# ----------------------------------------------------------------------------------------------- pure core


@functools.lru_cache(maxsize=4)
def cached_tokenizers(vocab_uri: str, lowercase: bool):
    """(the project's tokenizer, its normalizer-free twin) per worker process; the vocabulary is read once."""
    full = make_tokenizer(vocab_uri, lowercase)
    fast = make_tokenizer(vocab_uri, lowercase)
    fast.normalizer = None
    return full, fast


# The special tokens as the tokenizer matches them: in the raw text, exact case, before anything else
# (pipeline/formats/tokenizer.py). No other word the fast path makes contains "[", so a word equal to one is one.
_SPECIAL = re.compile("(" + "|".join(map(re.escape, SPECIAL_TOKENS)) + ")")
_SPECIAL_SET = frozenset(SPECIAL_TOKENS)


# BertPreTokenizer on printable ASCII: runs of letters/digits are words, every other non-space character is a word
# of its own (ASCII symbols count as punctuation). "\n" (never inside a plain sentence) marks sentence ends.
_PLAIN_WORD = re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9 \n]|\n")
# Any other sentence, once its ASCII control characters are deleted (the normalizer deletes them too): pieces that
# the BERT normalizer and pre-tokenizer treat independently, because both work character by character and split at
# ASCII whitespace and punctuation. A run with non-ASCII characters still needs both (accents, CJK, Unicode
# punctuation and spaces inside it); a run of ASCII letters/digits is one word; ASCII punctuation is one word.
_RUN = re.compile(r"(?:[A-Za-z0-9]|[^\x00-\x7f])+|[!-/:-@\[-`{-~]")
_DELETE_ASCII_CONTROLS = dict.fromkeys([*range(0, 9), 11, 12, *range(14, 32), 127])


def _has_special(sentence: str) -> bool:
    return "[" in sentence and _SPECIAL.search(sentence) is not None


def _runs(sentence: str) -> list[str]:
    """A sentence as `_RUN` pieces (ASCII control characters deleted), its literal special tokens split out first
    and kept whole: the tokenizer matches them in the raw text."""
    if not _has_special(sentence):
        return _RUN.findall(sentence.translate(_DELETE_ASCII_CONTROLS))
    return [p for i, part in enumerate(_SPECIAL.split(sentence))
            for p in ([part] if i % 2 else _RUN.findall(part.translate(_DELETE_ASCII_CONTROLS)))]


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
      pre-tokenizer (`_RUN`, `_normalize_runs`), all in one call; a literal special token ("[SEP]") is split out
      first and stays one word, which the tokenizer maps to its id, as Hugging Face's does;
    - then `_encode_words`: each distinct word tokenized once.
    """
    full, fast = tokenizers_pair
    sentences = [split_sentences(t or "") for t in texts]
    # Pass 1: printable-ASCII sentences as they are, the others as runs (their non-ASCII runs collected).
    items: list[str | list[str]] = []
    non_ascii: dict[str, None] = {}
    for s in itertools.chain.from_iterable(sentences):
        if s.isascii() and s.isprintable() and not _has_special(s):
            items.append(s)
        else:
            pieces = _runs(s)
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
                if piece in _SPECIAL_SET:
                    words.append(piece)
                elif piece.isascii():
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


# ------------------------------------------------------------------------------- pass 1: one task per block

# Buckets of the streaming shuffle: every pairing block spreads its (already shuffled) instances over G buckets,
# one record batch each, and bucket g becomes num_shards / G shards. More buckets would mean more, smaller
# reads for the reducers in every part file.
MAX_BUCKETS = 128
PASS_PARTS_DIR = "_parts"
_COUNTERS = ("doc_passes", "short_targets", "no_other_document", "random_next", "instance_tokens")


def num_buckets(num_shards: int) -> int:
    """The largest divisor of num_shards that is at most MAX_BUCKETS."""
    return max(g for g in range(1, min(num_shards, MAX_BUCKETS) + 1) if num_shards % g == 0)


def _write_part(uri: str, groups: list[pa.Table]) -> None:
    """An intermediate file: Arrow IPC, one record batch per group (random access by index, ~10x faster to write
    than Parquet; written once, read once, deleted)."""
    fs, path = storage.resolve(uri)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    schema = groups[0].schema
    tmp = storage.temp_path(path)
    with fs.open_output_stream(tmp) as f, pa.ipc.new_file(f, schema) as w:
        for group in groups:
            batches = group.combine_chunks().to_batches()  # one column chunk each: at most one batch
            assert len(batches) <= 1, f"group of {group.num_rows} rows gave {len(batches)} batches"
            w.write_batch(batches[0] if batches else pa.RecordBatch.from_pylist([], schema=schema))
    fs.move(tmp, path)


def _pair_length(flat, bounds, held, *, length, seed, key, dupe_factor, buckets, parts_uri, pair_kwargs) -> dict:
    """Training and held-out instances of one block at one length, written as part files; their counters."""
    train_bounds = [b for b, h in zip(bounds, held) if not h]
    held_bounds = [b for b, h in zip(bounds, held) if h]
    table, stats = pair_table(flat, train_bounds, max_seq_length=length, dupe_factor=dupe_factor,
                              seed_parts=(seed, "pairs", length, key), **pair_kwargs)
    # The rows are in random order already, so consecutive slices are random shares (zero-copy). The one extra
    # row of n % G buckets goes to buckets chosen from a random start, so bucket totals differ by at most one
    # row per block and few rows are dropped to equalise the shards.
    first = derive_seed(seed, "bucket", length, key) % buckets
    sizes = [table.num_rows // buckets + ((g - first) % buckets < table.num_rows % buckets) for g in range(buckets)]
    starts = np.cumsum([0, *sizes[:-1]])
    table = table.combine_chunks()
    rows = [table.slice(int(a), n) for a, n in zip(starts, sizes)]
    _write_part(storage.join(parts_uri, shards.seq_dir(length), f"train-{key}.arrow"), rows)
    held_table, _ = pair_table(flat, held_bounds, max_seq_length=length, dupe_factor=1,
                               seed_parts=(seed + 1, "pairs", length, key), **pair_kwargs)
    if held_table.num_rows:
        _write_part(storage.join(parts_uri, shards.seq_dir(length), f"heldout-{key}.arrow"), [held_table])
    random_next = int(np.asarray(table.column("next_sentence_label")).sum()) if table.num_rows else 0
    instance_tokens = int(np.asarray(table.column("num_tokens"), np.int64).sum()) if table.num_rows else 0
    return {f"rows_{length}": [r.num_rows for r in rows], f"held_{length}": held_table.num_rows,
            **{f"{name}_{length}": value for name, value in zip(_COUNTERS, (
                stats.num_doc_passes, stats.num_short_targets, stats.num_no_other_document, random_next,
                instance_tokens))}}


def pair_block(batch: pa.Table, *, vocab_uri: str, lowercase: bool, seeds: dict[int, int], heldout_fraction: float,
               dupe_factor: int, buckets: int, parts_uri: str, pair_kwargs: dict,
               progress: Reporter | None = None) -> pa.Table:
    """map_batches, the whole first pass on one pool of documents: tokenize once, then for every length pair the
    training documents (NotNext from the same pool) and the held-out ones, and write both as part files. Returns
    one row of counters: instances never travel through the object store."""
    ids = np.asarray(batch.column("id").cast(pa.int64()).to_numpy(zero_copy_only=False))
    encoders = cached_tokenizers(vocab_uri, lowercase)
    flat, bounds = encode_documents(batch.column("text").to_pylist(), encoders, lowercase)
    held = [is_heldout(int(i), heldout_fraction) for i in ids]
    # The block's identity comes from its content (Ray Data does not tell a batch its index): its seeds and file
    # names are the same on every run and on a retry.
    key = hashlib.sha256(ids.tobytes()).hexdigest()[:16]
    row: dict = {"key": key, "documents": len(ids), "tokens": int(flat.size)}
    for length, seed in seeds.items():
        row.update(_pair_length(flat, bounds, held, length=length, seed=seed, key=key, dupe_factor=dupe_factor,
                                buckets=buckets, parts_uri=parts_uri, pair_kwargs=pair_kwargs))
    if progress is not None:
        progress.add(len(ids))
    return pa.Table.from_pylist([row])


# --------------------------------------------------------------- pass 2: equal-row shards from the part files


def _read_group(uri: str, group: int | None) -> pa.Table:
    """Record batch `group` of a part file (None: all of it)."""
    fs, path = storage.resolve(uri)
    with fs.open_input_file(path) as f:
        reader = pa.ipc.open_file(f)
        return reader.read_all() if group is None else pa.Table.from_batches([reader.get_batch(group)])


def reduce_bucket(parts: list[str], group: int, shard_uris: list[str], rows_per_shard: int, schema_bytes: bytes,
                  seed: int) -> int:
    """Ray task: bucket `group` of every part file -> shuffled -> len(shard_uris) shards of rows_per_shard rows
    (the bucket's rows beyond that are dropped at random). Holds one bucket: total / G rows."""
    schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
    tables = [t for t in (_read_group(u, group) for u in parts) if t.num_rows]
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    order = np.random.default_rng(seed).permutation(table.num_rows)[: rows_per_shard * len(shard_uris)]
    table = table.take(order).cast(schema).replace_schema_metadata(schema.metadata)
    for k, uri in enumerate(shard_uris):
        shards.write_shard(uri, table.slice(k * rows_per_shard, rows_per_shard))
    return table.num_rows


def concat_parts(parts: list[str], uri: str, schema_bytes: bytes) -> int:
    """Ray task: the held-out part files, in order, as one shard."""
    schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
    tables = [_read_group(u, None) for u in parts]
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    shards.write_shard(uri, table.cast(schema).replace_schema_metadata(schema.metadata))
    return table.num_rows


# ------------------------------------------------------------------------------- what BERT will see, for a human

SAMPLE_INSTANCES = 5  # instances the stage shows decoded (google-research/bert's create_pretraining_data logs 20)
SAMPLE_FILE = "instances.txt"


def describe_instances(table: pa.Table, tokens: list[str]) -> str:
    """Instances decoded to text as create_pretraining_data.py logs them (tokens, segment_ids, is_random_next),
    plus segments A and B with the WordPiece pieces joined back into words."""
    blocks = []
    for ids, b_start, label in zip(table.column("input_ids").to_pylist(), table.column("segment_b_start").to_pylist(),
                                   table.column("next_sentence_label").to_pylist()):
        pieces = [tokens[i] for i in ids]
        blocks.append("\n".join([
            "*** Example ***",
            "tokens: " + " ".join(pieces),
            "segment_ids: " + " ".join("0" if k < b_start else "1" for k in range(len(ids))),
            f"is_random_next: {bool(label)}",
            "A: " + " ".join(pieces[1:b_start - 1]).replace(" ##", ""),
            "B: " + " ".join(pieces[b_start:-1]).replace(" ##", ""),
        ]))
    return "\n\n".join(blocks) + "\n"


def show_instances(ctx: StageContext, shard_uri: str, tokens: list[str]) -> str:
    """The first SAMPLE_INSTANCES rows of a training shard (the shards are shuffled: a random sample of what
    pre-training reads), decoded: in the log, the stage's MLflow run and its folder (SAMPLE_FILE)."""
    fs, path = storage.resolve(shard_uri)
    with fs.open_input_file(path) as f:
        head = pa.Table.from_batches([next(pq.ParquetFile(f).iter_batches(batch_size=SAMPLE_INSTANCES))])
    # Named relative to the stage folder: the file's bytes are the same wherever the workdir is.
    name = shard_uri[len(ctx.output_uri.rstrip("/")) + 1:] if shard_uri.startswith(ctx.output_uri) else shard_uri
    text = f"{name}, its first {head.num_rows} instances:\n\n" + describe_instances(head, tokens)
    log.info("pairs: what BERT will see: %s", text)
    ctx.log_text(text, SAMPLE_FILE)
    storage.write_text_atomic(storage.join(ctx.output_uri, SAMPLE_FILE), text)
    return text


# ------------------------------------------------------------------------------------------------ the stage


def describe_raw_inputs(cfg: PairsConfig) -> list[dict]:
    """None: pairs reads only stage outputs (the documents and the vocabulary), which enter its fingerprint by their
    manifests' output ids."""
    return []


def preflight(ctx: StageContext) -> None:
    """Before Ray starts: a vocab.txt the user names (vocab.path) reads as UTF-8 and has the special tokens."""
    path = ctx.section(VocabConfig).path
    if path:
        load_vocab(path)


def _lowercase(ctx: StageContext) -> bool:
    """do_lower_case as the vocab stage recorded it (its manifest), else the vocab config, else BERT's default."""
    extra = (ctx.input("vocab").manifest or {}).get("extra", {})
    if "do_lower_case" in extra:
        return bool(extra["do_lower_case"])
    cfg = [v for v in ctx.config.values() if isinstance(v, VocabConfig)]
    return cfg[0].lowercase if cfg else True


def _first_pass(ctx: StageContext, cfg: PairsConfig, files: list[str], block_kwargs: dict) -> list[dict]:
    """One Ray Data job over the documents: every block paired and written; its counter rows, sorted by key."""
    from ray.data import DataContext

    known = (ctx.input("clean").manifest or {}).get("num_rows")  # documents, when the clean stage made them
    data_ctx = DataContext.get_current()
    saved_order = data_ctx.execution_options.preserve_order
    data_ctx.execution_options.preserve_order = True  # same input -> same blocks -> same keys, seeds and bytes
    try:
        with ctx.console.remote_progress("pairs", known, "docs") as progress:
            ds = read_documents(files).map_batches(pair_block, batch_size=cfg.docs_per_partition,
                                                   batch_format="pyarrow", fn_kwargs={**block_kwargs,
                                                                                      "progress": progress})
            ds.set_name("pairs: tokenize + pair + write parts")  # what the Ray dashboard's Data page shows
            rows = ds.take_all()
    finally:
        data_ctx.execution_options.preserve_order = saved_order
    return sorted(rows, key=lambda r: r["key"])


def _second_pass(ctx, cfg, rows, length, seed, schema, parts_uri) -> dict:
    """Equal-row shards of one length from the part files (one task per bucket) and the held-out shard."""
    import ray

    buckets = num_buckets(cfg.num_shards)
    per_bucket = cfg.num_shards // buckets
    sizes = np.sum([r[f"rows_{length}"] for r in rows], axis=0) if rows else np.zeros(buckets, np.int64)
    total = int(sizes.sum())
    rows_per_shard = int(sizes.min()) // per_bucket
    if rows_per_shard == 0:
        raise StageInputError(f"{ctx.input('clean').uri} yields {total} instances at max_seq_length={length}: "
                              f"too few for pairs.num_shards={cfg.num_shards}")
    schema_bytes = schema.serialize().to_pybytes()
    part_dir = storage.join(parts_uri, shards.seq_dir(length))
    out_dir = storage.join(ctx.output_uri, shards.seq_dir(length))
    train_parts = [storage.join(part_dir, f"train-{r['key']}.arrow") for r in rows]
    pending = [ray.remote(reduce_bucket).remote(
        train_parts, g, [storage.join(out_dir, shards.train_shard_name(g * per_bucket + k)) for k in range(per_bucket)],
        rows_per_shard, schema_bytes, derive_seed(seed, "reduce", length, g) % 2**32) for g in range(buckets)]
    held_parts = [storage.join(part_dir, f"heldout-{r['key']}.arrow") for r in rows if r[f"held_{length}"]]
    pending.append(ray.remote(concat_parts).remote(held_parts, storage.join(out_dir, shards.HELDOUT_NAME),
                                                   schema_bytes))
    written = ray.get(pending)
    sums = {name: sum(r[f"{name}_{length}"] for r in rows) for name in _COUNTERS}
    kept = rows_per_shard * cfg.num_shards
    assert sum(written[:-1]) == kept, f"shards hold {written[:-1]} rows, expected {kept}"
    log.info("pairs: seq %d: %d instances (%.1f%% NotNext) -> %d shards x %d rows, %d dropped, %d held out",
             length, total, 100 * sums["random_next"] / max(total, 1), cfg.num_shards, rows_per_shard, total - kept,
             written[-1])
    return {
        f"instances_seq{length}": total,
        f"instances_written_seq{length}": kept,
        f"heldout_instances_seq{length}": written[-1],
        f"rows_dropped_for_equal_shards_seq{length}": total - kept,
        f"nsp_random_fraction_seq{length}": sums["random_next"] / max(total, 1),
        f"short_target_fraction_seq{length}": sums["short_targets"] / max(sums["doc_passes"], 1),
        f"no_other_document_chunks_seq{length}": sums["no_other_document"],
        f"instance_tokens_seq{length}": sums["instance_tokens"],
    }


def run_stage(ctx: StageContext) -> StageResult:
    cfg = ctx.section(PairsConfig)
    started = time.time()
    vocab_uri = vocab_file(ctx.input("vocab").uri)
    tokens_list = load_vocab(vocab_uri)
    specials = special_ids(tokens_list)
    lowercase = _lowercase(ctx)
    docs = ctx.input("clean")
    files = document_files(docs.uri, docs.manifest)
    v_hash = vocab_hash(vocab_uri)
    parts_uri = storage.join(ctx.output_uri, PASS_PARTS_DIR)
    seeds = {length: derive_seed(ctx.seed, "pairs", length) % 2**31 for length in cfg.max_seq_lengths}
    pair_kwargs = dict(short_seq_prob=cfg.short_seq_prob, cls_id=specials["[CLS]"], sep_id=specials["[SEP]"],
                       id_type=shards.id_type(len(tokens_list)))
    rows = _first_pass(ctx, cfg, files, dict(
        vocab_uri=vocab_uri, lowercase=lowercase, seeds=seeds, heldout_fraction=cfg.heldout_fraction,
        dupe_factor=cfg.dupe_factor, buckets=num_buckets(cfg.num_shards), parts_uri=parts_uri,
        pair_kwargs=pair_kwargs))
    num_docs, corpus_tokens = sum(r["documents"] for r in rows), sum(r["tokens"] for r in rows)
    log.info("pairs: %d documents, %d tokens paired in %d blocks (%.0f tokens/s)", num_docs, corpus_tokens,
             len(rows), corpus_tokens / max(time.time() - started, 1e-9))
    meta_common = dict(vocab_hash=v_hash, vocab_size=len(tokens_list), do_lower_case=lowercase, special_ids=specials)
    metrics: dict[str, float] = {}
    for length in cfg.max_seq_lengths:
        schema = shards.shard_schema(len(tokens_list), length, shards.shard_meta(max_seq_length=length, **meta_common))
        metrics.update(_second_pass(ctx, cfg, rows, length, seeds[length], schema, parts_uri))
    storage.delete_dir(parts_uri)
    first_shard = storage.join(ctx.output_uri, shards.seq_dir(cfg.max_seq_lengths[0]), shards.train_shard_name(0))
    show_instances(ctx, first_shard, tokens_list)

    seconds = time.time() - started
    first = cfg.max_seq_lengths[0]
    metrics.update({
        "documents": num_docs,
        "tokens": corpus_tokens,
        "tokens_per_second": corpus_tokens / max(seconds, 1e-9),
        "nsp_random_fraction": metrics[f"nsp_random_fraction_seq{first}"],
        "short_target_fraction": metrics[f"short_target_fraction_seq{first}"],
        "rows_dropped_for_equal_shards": sum(metrics[f"rows_dropped_for_equal_shards_seq{L}"]
                                             for L in cfg.max_seq_lengths),
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
