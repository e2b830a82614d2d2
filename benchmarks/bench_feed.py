"""Can one worker's input path keep a GPU busy? Sequences per second of the pre-training feed, stage by stage and
end to end, at seq 128 (micro 256) and 512 (micro 64), with the product's settings (shuffle buffer, length
binning window 8, dynamic masking, pinned host memory and a non-blocking copy when CUDA is there).

    python benchmarks/bench_feed.py [--rows 40000] [--cpus 2]

- stages: shard rows already in memory → length binning → masking/mask_batch → host-to-device copy, each timed alone
  on one thread (the training process's share of the work);
- end to end: Ray Data (read_parquet → streaming_split → iter_batches with the loop's prefetch and local
  shuffle), then binning, mask_batch and copy, as `streams.epoch_batches` + `run_epoch` do, on a local Ray of `--cpus`.

The target (issue 23): ≥ 3,000 sequences/s at seq 128 per worker. An H100 trains BERT-Large at ~1,440 seq/s.
Shards are synthetic at BERT's vocabulary size; rows are L/2 … L-3 tokens long (more padding work than real
shards, where 90% of rows are full length).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "tests"))

SHAPES = ((128, 256, 20), (512, 64, 80))
COLUMNS = ["input_ids", "segment_b_start", "next_sentence_label"]


def host_batches(table, micro: int):
    for b in table.to_batches(micro):
        if b.num_rows == micro:
            yield {k: b.column(k).to_numpy(zero_copy_only=False) for k in COLUMNS}


def timed(fn, items) -> tuple[float, list]:
    started = time.perf_counter()
    out = [fn(x) for x in items]
    return time.perf_counter() - started, out


def stage_rates(table, L: int, micro: int, P: int, vocab) -> dict[str, float]:
    import numpy as np
    import torch

    from bertpipe.jobs.pretrain import worker
    from bertpipe.jobs.pretrain.data.length_binning import length_binned
    from bertpipe.jobs.pretrain.data.masking import MaskingSpec, batch_rng, mask_batch

    spec = MaskingSpec.from_vocab(vocab, max_seq_length=L, max_predictions=P)
    raws = list(host_batches(table, micro))
    n = len(raws) * micro
    started = time.perf_counter()
    binned = list(length_binned(iter(raws), 8, np.random.default_rng(1)))
    t_bin = time.perf_counter() - started
    t_collate, batches = timed(lambda ib: mask_batch(ib[1], spec, batch_rng(1, 0, 0, 0, ib[0])), enumerate(binned))
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    t_copy, _ = timed(lambda b: worker.to_device(b, device), batches)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"length binning": n / t_bin, "masking + mask_batch": n / t_collate,
            f"to {device.type}" + (" (pinned, non-blocking)" if device.type == "cuda" else ""): n / t_copy,
            "stages together (one thread)": n / (t_bin + t_collate + t_copy)}


def end_to_end(files: list[str], L: int, micro: int, P: int, vocab) -> float:
    import numpy as np
    import torch

    from bertpipe.jobs.pretrain import worker
    from bertpipe.jobs.pretrain.data.length_binning import length_binned
    from bertpipe.jobs.pretrain.data.masking import MaskingSpec, batch_rng, mask_batch
    from bertpipe.pipeline.framework.ray_reads import read_parquet

    spec = MaskingSpec.from_vocab(vocab, max_seq_length=L, max_predictions=P)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    ds = read_parquet(files, COLUMNS)
    shard = ds.streaming_split(1, equal=True)[0]
    it = shard.iter_batches(batch_size=micro, batch_format="numpy", drop_last=True, prefetch_batches=4,
                            local_shuffle_buffer_size=2000, local_shuffle_seed=1)
    n, started = 0, None
    for i, raw in enumerate(length_binned(it, 8, np.random.default_rng(1))):
        if started is None:  # from the first batch on: Ray Data's start-up is not the steady rate
            started = time.perf_counter()
            continue
        worker.to_device(mask_batch(raw, spec, batch_rng(1, 0, 0, 0, i)), device)
        n += len(raw["next_sentence_label"])
    return n / (time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=40_000, help="rows at seq 128 (a quarter of them at 512)")
    ap.add_argument("--cpus", type=int, default=2, help="logical CPUs of the local Ray")
    args = ap.parse_args()
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray
    import torch

    import pretrain_helpers as h

    torch.set_num_threads(1)
    vocab = h.SPECIALS + [f"w{i}" for i in range(30_522 - len(h.SPECIALS))]
    results: dict[str, dict[int, float]] = {}
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        for L, micro, P in SHAPES:
            rows = args.rows if L == 128 else args.rows // 4
            table = h.make_rows(np.random.default_rng(0), rows, L)
            files = []
            for i, start in enumerate(range(0, rows, rows // 4)):
                files.append(f"{tmp}/seq{L}-{i}.parquet")
                pq.write_table(table.slice(start, rows // 4), files[-1])
            table = pa.concat_tables([pq.read_table(f) for f in files])
            for name, rate in stage_rates(table, L, micro, P, vocab).items():
                results.setdefault(name, {})[L] = rate
            results.setdefault(f"end to end through Ray Data ({args.cpus} CPUs)", {})[L] = end_to_end(
                files, L, micro, P, vocab)
    ray.shutdown()
    print("\nOne worker's feed, sequences/s (micro 256 at seq 128, 64 at 512); target ≥ 3,000 at 128")
    print("| stage | seq 128 | seq 512 |\n|---|---|---|")
    for name, by_len in results.items():
        print(f"| {name} | {by_len[128]:,.0f} | {by_len[512]:,.0f} |")


if __name__ == "__main__":
    main()
