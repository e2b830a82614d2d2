"""The pre-training shard format: schema, writer, reader of the metadata, listing and the vocabulary check.

Layout of the pairs stage's folder: `seq{L}/train-{i:05d}.parquet` (equal rows each) and `seq{L}/heldout.parquet`
for every max_seq_length L. One row per instance:

    input_ids            list<uint16> (list<int32> if the vocabulary has >= 65,536 entries), unpadded
                         [CLS] A [SEP] B [SEP]
    segment_b_start      int16, index of B's first token (token_type_ids = position >= segment_b_start)
    next_sentence_label  int8, 0 = IsNext, 1 = NotNext (as in the original code)
    num_tokens           int16, len(input_ids)

The Parquet schema metadata key b"bertpipe" holds JSON {"schema_version", "vocab_hash", "vocab_size",
"do_lower_case", "max_seq_length", "special_ids"}; training refuses shards whose vocab_hash differs from its own.
This module imports no Ray, no torch: the trainer reads shards without the preprocessing stack.
"""
from __future__ import annotations

import json
import os
import posixpath

import pyarrow as pa
import pyarrow.parquet as pq

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.stage import StageInputError, manifest_state

SHARD_SCHEMA_VERSION = 1
META_KEY = b"bertpipe"
HELDOUT_NAME = "heldout.parquet"


def seq_dir(max_seq_length: int) -> str:
    return f"seq{max_seq_length}"


def train_shard_name(index: int) -> str:
    return f"train-{index:05d}.parquet"


def id_type(vocab_size: int) -> pa.DataType:
    return pa.uint16() if vocab_size < 65_536 else pa.int32()


def shard_meta(*, vocab_hash: str, vocab_size: int, do_lower_case: bool, max_seq_length: int,
               special_ids: dict[str, int]) -> dict:
    return {
        "schema_version": SHARD_SCHEMA_VERSION,
        "vocab_hash": vocab_hash,
        "vocab_size": int(vocab_size),
        "do_lower_case": bool(do_lower_case),
        "max_seq_length": int(max_seq_length),
        "special_ids": {k: int(v) for k, v in special_ids.items()},
    }


def shard_schema(vocab_size: int, max_seq_length: int, meta: dict) -> pa.Schema:
    """The shard schema with the bertpipe metadata attached; `meta` must agree with vocab_size/max_seq_length."""
    if meta.get("vocab_size") != vocab_size or meta.get("max_seq_length") != max_seq_length:
        raise ValueError(f"shard metadata {meta} disagrees with vocab_size={vocab_size}, "
                         f"max_seq_length={max_seq_length}")
    if max_seq_length > 32_767:
        raise ValueError(f"max_seq_length={max_seq_length} does not fit the int16 columns")
    return pa.schema(
        [
            ("input_ids", pa.list_(id_type(vocab_size))),
            ("segment_b_start", pa.int16()),
            ("next_sentence_label", pa.int8()),
            ("num_tokens", pa.int16()),
        ],
        metadata={META_KEY: json.dumps(meta, sort_keys=True).encode()},
    )


# Rows per Parquet row group of a shard: a reader streams a shard a row group at a time, without loading it whole.
SHARD_ROW_GROUP_ROWS = 65_536

# The shard columns pre-training reads (what jobs/pretrain/data/masking.py's mask_batch takes): the streams, the
# held-out reads and the stage's check of each shard select these.
TRAINING_COLUMNS = ["input_ids", "segment_b_start", "next_sentence_label"]


def write_shard(uri: str, table: pa.Table) -> None:
    """Write one shard (table already in shard_schema, metadata included) to a temporary name, then rename it."""
    if META_KEY not in (table.schema.metadata or {}):
        raise ValueError(f"refusing to write {uri}: the table carries no {META_KEY!r} metadata (use shard_schema)")
    fs, path = storage.resolve(uri)
    parent = posixpath.dirname(path) if storage.is_remote(uri) else os.path.dirname(path)
    fs.create_dir(parent, recursive=True)
    tmp = storage.temp_path(path)
    with fs.open_output_stream(tmp) as f:
        pq.write_table(table, f, row_group_size=SHARD_ROW_GROUP_ROWS, compression="zstd")
    fs.move(tmp, path)


def read_shard_meta(uri: str) -> dict:
    """The bertpipe metadata of a shard; StageInputError naming the file if it is not a readable shard."""
    fs, path = storage.resolve(uri)
    try:
        with fs.open_input_file(path) as f:
            schema = pq.read_schema(f)
    except (OSError, pa.ArrowException) as exc:
        raise StageInputError(f"{uri} is not a readable Parquet shard: {exc}") from exc
    raw = (schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise StageInputError(f"{uri} has no {META_KEY.decode()} metadata: not a pre-training shard of this project")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise StageInputError(f"{uri}: malformed {META_KEY.decode()} metadata: {exc}") from exc
    if meta.get("schema_version") != SHARD_SCHEMA_VERSION:
        raise StageInputError(f"{uri} has shard schema version {meta.get('schema_version')}, "
                              f"this code reads version {SHARD_SCHEMA_VERSION}")
    return meta


def list_shards(pairs_uri: str, max_seq_length: int) -> tuple[list[str], str]:
    """(train shard URIs sorted, held-out URI) of one length. From the manifest of a committed pairs folder; a
    folder without one (shards a user names explicitly, `pretrain.input`) is listed as it is."""
    manifest, problem = manifest_state(pairs_uri)
    if problem:
        raise StageInputError(f"shard folder {pairs_uri}: {problem}")
    if manifest is not None:
        files = [f["path"].replace(os.sep, "/") for f in manifest.get("files", [])]
    elif storage.exists(pairs_uri):
        files = [p.replace(os.sep, "/") for p, _ in storage.list_files(pairs_uri)]
    else:
        raise StageInputError(f"shard folder {pairs_uri} does not exist")
    prefix = seq_dir(max_seq_length) + "/"
    train = sorted(p for p in files if p.startswith(prefix + "train-") and p.endswith(".parquet"))
    if not train:
        lengths = sorted({p.split("/")[0] for p in files if p.startswith("seq")})
        raise StageInputError(f"{pairs_uri} has no shards for max_seq_length={max_seq_length} (it has {lengths})")
    heldout = prefix + HELDOUT_NAME
    if heldout not in files:
        raise StageInputError(f"{pairs_uri} has no held-out shard {heldout}")
    return [storage.join(pairs_uri, *p.split("/")) for p in train], storage.join(pairs_uri, *heldout.split("/"))


def check_vocab(meta: dict, expected_vocab_hash: str, uri: str) -> None:
    """Refuse shards built with another vocabulary than the model's."""
    if meta.get("vocab_hash") != expected_vocab_hash:
        raise StageInputError(
            f"shards in {uri} were built with vocabulary {meta.get('vocab_hash')} "
            f"but the model uses {expected_vocab_hash}"
        )
