"""jobs/pretrain/data/heldout.py: each worker's held-out rows, read straight from the shard."""
import numpy as np
import pyarrow.parquet as pq
import pytest

from bertpipe.jobs.pretrain.data.heldout import read_heldout
from bertpipe.jobs.pretrain.data.masking import MaskingSpec, mask_batch
from pretrain_helpers import TOKENS, make_rows


def shard(tmp_path, rows: int):
    path = tmp_path / "heldout.parquet"
    pq.write_table(make_rows(np.random.default_rng(3), rows, 32), path, row_group_size=50)  # several row groups
    return str(path), pq.read_table(path).column("input_ids").to_pylist()


def ids_of(batches) -> list[list[int]]:
    return [list(map(int, row)) for b in batches for row in b["input_ids"]]


@pytest.mark.parametrize("world, max_batches, per_worker", [(2, 100, 115), (3, 2, 16), (4, 1, 8)])
def test_workers_get_equal_disjoint_blocks_in_file_order(tmp_path, world, max_batches, per_worker):
    uri, rows = shard(tmp_path, 231)
    got = [read_heldout(uri, r, world, 231, max_batches, batch_size=8) for r in range(world)]
    for r, batches in enumerate(got):
        assert all(len(b["next_sentence_label"]) == 8 for b in batches[:-1])
        assert ids_of(batches) == rows[r * per_worker:(r + 1) * per_worker]
    assert len({len(b) for b in got}) == 1  # the same number of forwards on every rank


def test_batches_collate_like_ray_data_batches(tmp_path):
    uri, rows = shard(tmp_path, 40)
    batch = read_heldout(uri, 0, 1, 40, 1, batch_size=16)[0]
    out = mask_batch(batch, MaskingSpec.from_vocab(TOKENS, max_seq_length=32, max_predictions=5),
                  np.random.default_rng(0))
    assert out["input_ids"].shape[0] == 16
    assert out["attention_mask"].sum(dim=1).tolist() == [len(r) for r in rows[:16]]


def test_a_shard_shorter_than_counted_is_an_error(tmp_path):
    uri, _ = shard(tmp_path, 40)
    with pytest.raises(ValueError, match="has 40 rows, 100 were counted"):
        read_heldout(uri, 1, 2, 100, 10, batch_size=8)
