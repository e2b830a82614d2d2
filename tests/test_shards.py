"""Shard schema, writer and reader-side checks."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bertpipe.pipeline.formats import shards
from bertpipe.pipeline.framework.stage import StageInputError

SPECIALS = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}


def _meta(vocab_size=30_522, length=128, h="ab" * 32):
    return shards.shard_meta(vocab_hash=h, vocab_size=vocab_size, do_lower_case=True, max_seq_length=length,
                             special_ids=SPECIALS)


def _table(schema):
    return pa.table({"input_ids": [[101, 7, 102, 9, 11, 102]], "segment_b_start": [3], "next_sentence_label": [1],
                     "num_tokens": [6]}).cast(schema)


def test_schema_types_and_metadata(tmp_path):
    schema = shards.shard_schema(30_522, 128, _meta())
    assert schema.field("input_ids").type == pa.list_(pa.uint16())
    assert [schema.field(c).type for c in ("segment_b_start", "next_sentence_label", "num_tokens")] == \
        [pa.int16(), pa.int8(), pa.int16()]
    big = shards.shard_schema(70_001, 512, _meta(70_001, 512))
    assert big.field("input_ids").type == pa.list_(pa.int32())
    uri = str(tmp_path / "seq128" / "train-00000.parquet")
    shards.write_shard(uri, _table(schema))
    meta = shards.read_shard_meta(uri)
    assert meta == _meta() and json.loads(pq.read_schema(uri).metadata[b"bertpipe"]) == meta
    assert not list((tmp_path / "seq128").glob("*.tmp"))
    with pytest.raises(ValueError):
        shards.shard_schema(30_522, 512, _meta())  # disagreeing metadata


def test_read_meta_errors_name_the_file(tmp_path):
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet")
    with pytest.raises(StageInputError, match="junk.parquet"):
        shards.read_shard_meta(str(junk))
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"x": [1]}), plain)
    with pytest.raises(StageInputError, match="plain.parquet.*no bertpipe"):
        shards.read_shard_meta(str(plain))


def test_check_vocab():
    shards.check_vocab(_meta(h="a" * 64), "a" * 64, "/x")
    with pytest.raises(StageInputError, match=r"shards in /x were built with vocabulary b+ but the model uses c+"):
        shards.check_vocab(_meta(h="b" * 64), "c" * 64, "/x")


def test_list_shards_reads_the_manifest_of_a_committed_folder_and_lists_a_bare_one(tmp_path):
    from bertpipe.pipeline.framework.stage import StageResult, write_manifest

    schema = shards.shard_schema(30_522, 128, _meta())
    for i in (1, 0, 2):
        shards.write_shard(str(tmp_path / "seq128" / shards.train_shard_name(i)), _table(schema))
    shards.write_shard(str(tmp_path / "seq128" / "heldout.parquet"), _table(schema))
    bare, _ = shards.list_shards(str(tmp_path), 128)  # an explicit shard folder (pretrain.input) has no manifest
    assert len(bare) == 3
    write_manifest(str(tmp_path), stage="pairs", fingerprint="f", result=StageResult(num_rows=3), config={},
                   inputs={}, started=0.0, code_version="t")
    # A file written after the commit is not part of the committed output.
    shards.write_shard(str(tmp_path / "seq128" / shards.train_shard_name(3)), _table(schema))
    train, held = shards.list_shards(str(tmp_path), 128)
    names = [p.rsplit("/", 1)[-1] for p in train]
    assert names == ["train-00000.parquet", "train-00001.parquet", "train-00002.parquet"]
    assert held == str(tmp_path / "seq128" / "heldout.parquet")
    with pytest.raises(StageInputError, match="max_seq_length=512"):
        shards.list_shards(str(tmp_path), 512)
    with pytest.raises(StageInputError, match="does not exist"):
        shards.list_shards(str(tmp_path / "nowhere"), 128)
