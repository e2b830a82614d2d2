"""How long the pre-training stage waits for its data streams: the four datasets a two-phase run hands Ray Train
(training and held-out rows at seq 128 and 512), each split between 2 workers as Ray Train splits them, opened at
once as data.streams.WorkerData.open_all opens them; the time until every worker holds its first micro-batch.

    python benchmarks/bench_open_streams.py PAIRS_FOLDER [--cpus 4] [--repeats 3]

PAIRS_FOLDER is a pairs stage's output (`make run` leaves one in work/tiny/pairs). Side by side in one Ray: Ray
Data's default Parquet reader (DataSourceV2) and the one the product uses (pipeline/framework/ray_reads.py),
alternating.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

COLUMNS = ["input_ids", "segment_b_start", "next_sentence_label"]


def datasets(pairs: str, reader) -> list:
    from bertpipe.pipeline.formats.shards import list_shards

    out = []
    for length in (128, 512):
        train, heldout = list_shards(pairs, length)
        out += [reader(train), reader([heldout])]
    return out


def open_all(streams: list, workers: int = 2) -> float:
    """Seconds until every worker of every stream has its first batch of 16 rows."""
    started = time.perf_counter()

    def first_batch(split):
        next(iter(split.iter_batches(batch_size=16, batch_format="numpy")), None)

    threads = [threading.Thread(target=first_batch, args=(split,))
               for ds in streams for split in ds.streaming_split(workers, equal=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def main() -> None:
    import os

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pairs")
    parser.add_argument("--cpus", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import ray
    import ray.data

    from bertpipe.pipeline.framework.ray_reads import read_parquet

    pairs = os.path.abspath(args.pairs)
    ray.init(num_cpus=args.cpus, log_to_driver=False, include_dashboard=False)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.execution_options.preserve_order = True  # as the pre-training stage runs them
    readers = {"Ray Data default (DataSourceV2)": lambda files: ray.data.read_parquet(files, columns=COLUMNS),
               "bertpipe (pipeline/framework/ray_reads.py)": lambda files: read_parquet(files, COLUMNS)}
    times: dict[str, list[float]] = {name: [] for name in readers}
    for _ in range(args.repeats):
        for name, reader in readers.items():
            times[name].append(open_all(datasets(pairs, reader)))
    ray.shutdown()
    print(f"\nopening 4 streams × 2 workers, {args.cpus} logical CPUs, {args.repeats} repeats (median)\n")
    print("| reader | seconds (median) | all |\n|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.1f} | {', '.join(f'{x:.1f}' for x in t)} |")
    base, ours = (statistics.median(t) for t in times.values())
    print(f"\nratio default / bertpipe: {base / ours:.1f}×")


if __name__ == "__main__":
    main()
