"""Integration on local Ray: vocab stage then pairs stage through run_stage, shards checked against the contract."""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _clean_docs import clean_folder  # noqa: E402

from bertpipe.pipeline.formats import shards  # noqa: E402
from bertpipe.pipeline.stages.config import PairsConfig, VocabConfig  # noqa: E402
from bertpipe.pipeline.framework.stage import StageContext, StageInput, read_manifest, write_manifest  # noqa: E402


def _run(module, name, out, config, inputs, seed=12345):
    ctx = StageContext(name=name, output_uri=str(out), config=config, seed=seed,
                       inputs={k: StageInput(k, str(v), read_manifest(str(v))) for k, v in inputs.items()})
    started = time.time()
    result = module.run_stage(ctx)
    write_manifest(str(out), stage=name, fingerprint="t", result=result, config={}, inputs={}, started=started,
                   code_version="t")
    return result


@pytest.fixture(scope="module")
def built(ray_local, enwiki_sample, tmp_path_factory):
    from bertpipe.pipeline.stages import pairs, vocab

    tmp = tmp_path_factory.mktemp("pairs")
    clean, source = clean_folder(enwiki_sample, tmp, ray_ok=True)
    vres = _run(vocab, "vocab", tmp / "vocab", {"vocab": VocabConfig(vocab_size=5_003)}, {"clean": clean})
    cfg = PairsConfig(max_seq_lengths=(64, 256), num_shards=3, dupe_factor=2, heldout_fraction=0.05,
                      docs_per_partition=37)
    runs = [_run(pairs, "pairs", tmp / f"pairs{k}", {"pairs": cfg}, {"clean": clean, "vocab": tmp / "vocab"}, seed)
            for k, seed in enumerate((7, 7, 8))]
    return tmp, cfg, vres, runs, source


def test_shards_follow_the_contract(built):
    tmp, cfg, vres, runs, source = built
    out = tmp / "pairs0"
    result = runs[0]
    for length in cfg.max_seq_lengths:
        train, held = shards.list_shards(str(out), length)
        assert len(train) == 3
        counts = [pq.read_metadata(u).num_rows for u in train]
        assert len(set(counts)) == 1 and counts[0] > 0
        assert result.metrics[f"instances_seq{length}"] == counts[0] * 3 + result.metrics[
            f"rows_dropped_for_equal_shards_seq{length}"]
        meta = shards.read_shard_meta(train[0])
        assert meta == {"schema_version": 1, "vocab_hash": vres.extra["vocab_hash"], "vocab_size": vres.num_rows,
                        "do_lower_case": True, "max_seq_length": length,
                        "special_ids": {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}}
        shards.check_vocab(meta, vres.extra["vocab_hash"], str(out))
        table = pq.read_table(train[1])
        assert str(table.schema.field("input_ids").type) == "list<element: uint16>"
        assert [str(table.schema.field(c).type) for c in ("segment_b_start", "next_sentence_label", "num_tokens")] \
            == ["int16", "int8", "int16"]
        ids = table.column("input_ids").to_pylist()
        assert max(map(len, ids)) <= length
        for x, s in zip(ids, table.column("segment_b_start").to_pylist()):
            assert x[0] == 101 and x[s - 1] == 102 and x[-1] == 102 and x.count(102) == 2
        assert pq.read_metadata(held).num_rows > 0
    assert 0.45 < result.metrics["nsp_random_fraction"] < 0.6
    assert 0.03 < result.metrics["short_target_fraction"] < 0.2
    assert result.metrics["tokens"] > 100_000 and result.metrics["tokens_per_second"] > 0
    print(f"clean input: {source}; metrics: {json.dumps(result.metrics, indent=1)}")


def test_same_seed_same_bytes_other_seed_differs(built):
    tmp, cfg, _, _, _ = built

    def digest(folder):
        return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.rglob("*.parquet"))}

    a, b, c = digest(tmp / "pairs0"), digest(tmp / "pairs1"), digest(tmp / "pairs2")
    assert a == b and len(a) == 8
    assert a["seq64/train-00000.parquet"] != c["seq64/train-00000.parquet"]
    # The held-out documents do not depend on the seed (chosen by doc-id hash).


def test_part_files_are_gone_and_pools_were_paired_apart(built):
    from bertpipe.pipeline.stages.pairs import PASS_PARTS_DIR

    tmp, cfg, _, runs, _ = built
    assert not (tmp / "pairs0" / PASS_PARTS_DIR).exists()
    # With docs_per_partition=37 the ~90 training documents make several pools, each paired on its own.
    assert runs[0].metrics["documents"] > 2 * cfg.docs_per_partition
    assert runs[0].metrics["pools"] >= 3 and runs[0].metrics["tasks_killed_for_memory"] == 0


def test_the_stage_shows_its_first_instances_decoded(built):
    """instances.txt (also logged, and an MLflow artifact under the workflow): the first rows of the first shard."""
    from bertpipe.pipeline.stages.pairs import SAMPLE_FILE, SAMPLE_INSTANCES

    tmp, _, _, _, _ = built
    vocab = (tmp / "vocab" / "vocab.txt").read_text(encoding="utf-8").split("\n")
    first = pq.read_table(tmp / "pairs0" / "seq64" / "train-00000.parquet").slice(0, SAMPLE_INSTANCES)
    examples = (tmp / "pairs0" / SAMPLE_FILE).read_text(encoding="utf-8").split("*** Example ***\n")[1:]
    assert len(examples) == SAMPLE_INSTANCES
    for ids, example in zip(first.column("input_ids").to_pylist(), examples):
        assert example.split("\n")[0] == "tokens: " + " ".join(vocab[i] for i in ids)
