"""The data stages (clean -> vocab -> pairs) as the corpus grows: wall time, throughput, share of the pure core on
the same cores, peak memory (the node's, this run's processes', the largest task's), tasks Ray killed for memory,
peak object-store use and bytes spilled; and where pairs spends its time (pass 1, the shuffle, the shard writes).

The corpus is the real enwiki sample replicated xN with new page ids, written as a multistream dump (bz2 streams
of 100 pages) with its index, as Wikimedia publishes them, so the clean stage reads one file with several
workers. The xN dumps share their replicas: the largest file is built once (two processes compress replicas) and
the smaller ones are its first N replicas plus the footer. Everything lives in a temp folder, never in the repo
(--keep DIR: there, and dumps already built there are used again).

Each stage runs through the workflow (`bertpipe.jobs.workflow.run(only=[stage])`) in this process, which is the
driver; pairs runs once per shard count (--num-shards: the tiny preset's 4 and bert_large's 4,096 by default). A
sampler thread records every 0.5 s: the node's used memory (total - available) above what it was when the stage
started (other users of the machine move it); this run's memory: the private resident memory of this process and of
every process below it (the local Ray: GCS, raylet, workers), plus the object store's use; the largest private
memory of one Ray worker and the task it ran (its process title); the object store's use and spill (Ray's memory
summary). The pure cores run in this process
on one core, on the smallest corpus (their throughput does not depend on size): clean = `iter_pages` +
`clean_pages_batch`, pairs = `encode_documents` + `pair_table` per pool at every length, vocab = `train_vocab` on
the same sample the stage drew. Share = stage throughput / (pure core per core x cores used); for vocab (the Rust
trainer is multi-threaded on both sides) share = pure seconds / stage seconds.

    python benchmarks/bench_scale.py [--sizes 10,30,300] [--num-shards 4,4096] [--num-cpus 2]
                                     [--vocab-sample-mb 50] [--split-mb 8] [--docs-per-pool 500]
                                     [--max-task-mib N] [--keep DIR] [--json FILE]
"""
from __future__ import annotations

import argparse
import bz2
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
PAGES_PER_STREAM = 100
_PAGE = re.compile(r"[ \t]*<page>.*?</page>\n?", re.S)


# ------------------------------------------------------------------------------------------ the corpus


def _replica_streams(args: tuple[list[str], int]) -> list[tuple[bytes, list[tuple[int, str]]]]:
    """One replica's pages, ids shifted by k * 100,000,000, as bz2 streams with their (page id, title) lists."""
    pages, k = args
    out = []
    for i in range(0, len(pages), PAGES_PER_STREAM):
        group = [re.sub(r"(</ns>\s*<id>)(\d+)(</id>)", lambda m: f"{m.group(1)}{int(m.group(2)) + k * 100_000_000}"
                        f"{m.group(3)}", p, count=1) for p in pages[i:i + PAGES_PER_STREAM]]
        ids = [(int(re.search(r"</ns>\s*<id>(\d+)</id>", p).group(1)), re.search(r"<title>(.*?)</title>", p).group(1))
               for p in group]
        out.append((bz2.compress("".join(group).encode(), 9), ids))
    return out


def build_dumps(sample: Path, sizes: list[int], folder: Path) -> dict[int, Path]:
    """enwiki-xN-pages-articles-multistream.xml.bz2 (+ -index.txt.bz2) for every N in `sizes`."""
    xml = bz2.decompress(sample.read_bytes()).decode("utf-8")
    pages = [m.group() for m in _PAGE.finditer(xml)]
    header, footer = xml[: xml.index(pages[0])], xml[xml.rindex(pages[-1]) + len(pages[-1]):]
    with ProcessPoolExecutor(2) as pool:
        replicas = list(pool.map(_replica_streams, [(pages, k) for k in range(max(sizes))]))
    out = {}
    for n in sizes:
        dump = folder / f"enwiki-x{n}-pages-articles-multistream.xml.bz2"
        index = []
        with open(dump, "wb") as f:
            f.write(bz2.compress(header.encode()))
            for streams in replicas[:n]:
                for data, ids in streams:
                    index.extend(f"{f.tell()}:{pid}:{title}\n" for pid, title in ids)
                    f.write(data)
            f.write(bz2.compress(footer.encode()))
        dump.with_name(dump.name.replace(".xml.bz2", "-index.txt.bz2")).write_bytes(
            bz2.compress("".join(index).encode()))
        out[n] = dump
    return out


# ------------------------------------------------------------------------------------------ measuring


PAGE = os.sysconf("SC_PAGE_SIZE")


def _private(pid: int) -> int:
    """Resident bytes of a process that are its own (resident minus shared: file pages and the object store's shared
    memory are counted apart), from /proc/PID/statm: O(1), where smaps_rollup walks every mapping (45 ms for the
    Ray processes here, a core's fifth at two samples a second, stolen from the stage being measured)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


class Sampler:
    """Peaks, sampled every 0.5 s: the node's used memory above the start; this run's memory: the private resident
    bytes of this process and every process below it (the local Ray: GCS, raylet, workers) plus the object store's
    use; the largest private memory of one of its processes (and the title Ray gave it: the task); this process's
    RSS; the object store's use and spilled MiB."""

    def __init__(self):
        self.rss = self.store = self.node = self.ours = self.task = 0.0
        self.task_title = ""
        self.spilled_start = self.spilled = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        vm = psutil.virtual_memory()
        self.node_start = vm.total - vm.available

    def _store(self) -> tuple[float, float]:
        import ray
        from ray._private.internal_api import memory_summary

        if not ray.is_initialized():
            return 0.0, 0.0
        text = memory_summary(stats_only=True)
        used = re.search(r"Plasma memory usage (\d+) MiB", text)
        spilled = re.search(r"Spilled (\d+) MiB", text)
        return float(used.group(1)) if used else 0.0, float(spilled.group(1)) if spilled else 0.0

    def _processes(self, proc: psutil.Process, store_mib: float) -> None:
        ours = _private(proc.pid)
        for child in proc.children(recursive=True):
            private = _private(child.pid)
            ours += private
            if private / 2**20 > self.task:
                try:
                    title = " ".join(child.cmdline())[:60]
                except psutil.Error:
                    continue
                self.task, self.task_title = private / 2**20, title
        self.ours = max(self.ours, ours / 2**20 + store_mib)

    def _loop(self) -> None:
        proc = psutil.Process()
        while not self._stop.is_set():
            self.rss = max(self.rss, proc.memory_info().rss / 2**20)
            vm = psutil.virtual_memory()
            self.node = max(self.node, (vm.total - vm.available - self.node_start) / 2**20)
            try:
                used, spilled = self._store()
            except Exception:  # noqa: BLE001 - Ray starting or stopping: skip this sample
                used, spilled = 0.0, None
            self._processes(proc, used)
            self.store = max(self.store, used)
            if spilled is not None:
                self.spilled_start = spilled if self.spilled_start is None else self.spilled_start
                self.spilled = spilled
            self._stop.wait(0.5)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def spilled_mib(self) -> float:
        return (self.spilled or 0.0) - (self.spilled_start or 0.0)

    def figures(self) -> dict:
        return {"rss_mib": self.rss, "store_mib": self.store, "spilled_mib": self.spilled_mib,
                "node_mib": self.node, "ours_mib": self.ours, "task_mib": self.task, "task_title": self.task_title}


def run_stages(dump: Path, work: Path, args) -> dict[str, dict]:
    """clean and vocab once, then pairs at every shard count: {"clean": ..., "vocab": ..., "pairs/4": ...}."""
    from bertpipe.jobs import workflow
    from bertpipe.jobs.cluster import ensure_ray
    from bertpipe.jobs.config import load_config
    from bertpipe.pipeline.framework.stage import read_manifest

    def config(num_shards: int):
        budget = [f"pairs.max_task_bytes={args.max_task_mib * 2**20}"] if args.max_task_mib else []
        return load_config(str(REPO / "configs" / "tiny.yaml"), [
            f"clean.input=[{dump}]", f"ray.num_cpus={args.num_cpus}", "ray.dashboard=false",
            "mlflow.tracking_uri=off", "vocab.vocab_size=30522",
            f"vocab.max_sample_bytes={int(args.vocab_sample_mb * 1e6)}", "pairs.dupe_factor=10",
            f"pairs.num_shards={num_shards}", "pairs.max_seq_lengths=[128, 512]",
            f"pairs.docs_per_partition={args.docs_per_pool}", f"clean.num_read_workers={args.read_workers}",
            f"clean.split_bytes={args.split_mb * 1_000_000}", *budget], workdir=str(work))

    ensure_ray("", args.num_cpus, False)  # started before the clock: Ray's start-up is not a stage's cost
    runs = [(stage, args.num_shards[0]) for stage in ("clean", "vocab") if stage in args.stages]
    runs += [("pairs", n) for n in args.num_shards] if "pairs" in args.stages else []
    out = {}
    for stage, num_shards in runs:
        cfg = config(num_shards)
        load = os.getloadavg()[0]
        with Sampler() as s:
            workflow.run(cfg, only=[stage], force=True)
        m = read_manifest(workflow.stage_uri(cfg, stage))
        key = f"pairs/{num_shards}" if stage == "pairs" else stage
        out[key] = {"seconds": m["seconds"], "metrics": m["metrics"], "load_before": load,
                    "load_after": os.getloadavg()[0], **s.figures()}
        print(f"x{dump.name.split('-x')[-1].split('-')[0]} {key}: {m['seconds']:.1f} s, node +{s.node:.0f} MiB, ours "
              f"{s.ours:.0f} MiB, largest task {s.task:.0f} MiB ({s.task_title}), load {load:.1f} -> "
              f"{out[key]['load_after']:.1f}", flush=True)
    return out


def pure_clean(dump: Path) -> float:
    """MB of wikitext per second, one process."""
    import numpy as np

    from bertpipe.pipeline.stages.clean import clean_pages_batch
    from bertpipe.pipeline.stages.dump_reader import iter_pages

    t, mb, batch = time.perf_counter(), 0.0, []

    def flush():
        cols = {k: np.array([getattr(p, k) for p in batch], dtype=object) for k in ("id", "ns", "title", "text")}
        cols.update(ns=cols["ns"].astype(np.int64), redirect=np.array([p.redirect for p in batch]),
                    num_bytes=np.array([p.num_bytes for p in batch], np.int64),
                    truncated=np.array([p.truncated for p in batch]), source=np.array(["x"] * len(batch), dtype=object))
        out = clean_pages_batch(cols, min_paragraph_chars=20, min_article_chars=200, skip_disambiguation=True)
        batch.clear()
        return float(out["wikitext_bytes"].sum()) / 1e6

    for page in iter_pages(str(dump)):
        batch.append(page)
        if len(batch) == 64:
            mb += flush()
    if batch:
        mb += flush()
    return mb / (time.perf_counter() - t)


def pure_pairs(clean_dir: Path, vocab: Path, docs_per_pool: int = 2_000) -> float:
    """Corpus tokens per second through tokenize + pair at 128 and 512 (dupe 10), one process."""
    import pyarrow.parquet as pq

    from bertpipe.pipeline.formats import shards
    from bertpipe.pipeline.stages.encoding import cached_tokenizers, encode_documents
    from bertpipe.pipeline.stages.pair_pools import pair_table
    from bertpipe.pipeline.formats.vocabulary import load_vocab, special_ids

    tokens_list = load_vocab(str(vocab))
    sp = special_ids(tokens_list)
    texts = pq.read_table(clean_dir, columns=["text"]).column("text").to_pylist()
    pair = cached_tokenizers(str(vocab), True)
    t, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), docs_per_pool):
        flat, bounds = encode_documents(texts[i:i + docs_per_pool], pair, True)
        tokens += flat.size
        for length in (128, 512):
            pair_table(flat, bounds, max_seq_length=length, short_seq_prob=0.1, dupe_factor=10,
                       seed_parts=(1, length, i), cls_id=sp["[CLS]"], sep_id=sp["[SEP]"],
                       id_type=shards.id_type(len(tokens_list)))
    return tokens / (time.perf_counter() - t)


def pure_vocab(clean_dir: Path, sample_mb: float, seed: int) -> float:
    """Seconds of `train_vocab` on the sample the stage drew (same pieces and seed), in this process."""
    from bertpipe.pipeline.stages.config import VocabConfig
    from bertpipe.pipeline.stages.documents import document_files, sample_pieces, text_pieces
    from bertpipe.pipeline.stages.vocab import train_vocab

    pieces = sample_pieces(text_pieces(document_files(str(clean_dir))), int(sample_mb * 1e6), seed)
    t = time.perf_counter()
    train_vocab(pieces, VocabConfig(vocab_size=30_522))
    return time.perf_counter() - t


# ------------------------------------------------------------------------------------------ the table


def report(results: dict[int, dict], pure: dict[str, float], cores: int, sizes: dict[int, Path]) -> None:
    print(f"\n## Pure cores (one process, x{min(results)} corpus): clean {pure.get('clean', 0):.1f} MB/s, pairs "
          f"{pure.get('pairs', 0) / 1e3:,.0f}k tokens/s; vocab: train_vocab on each size's sample; stages on {cores} "
          f"CPUs")
    print("| corpus | stage | wall s | throughput | share of pure core | node used +MiB | this run's MiB "
          "| largest task MiB | killed for memory | peak object store MiB | spilled MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, res in results.items():
        label = f"x{n} ({sizes[n].stat().st_size / 1e6:.0f} MB bz2)"
        for key, r in res.items():
            m = r["metrics"]
            share = ""
            if key == "clean":
                rate = m["mb_wikitext"] / r["seconds"]
                thr = f"{rate:.1f} MB wikitext/s"
                share = f"{rate / (pure['clean'] * cores):.0%}" if "clean" in pure else ""
            elif key.startswith("pairs"):
                rate = m["tokens"] / r["seconds"]
                thr = f"{rate / 1e3:,.0f}k tokens/s"
                share = f"{rate / (pure['pairs'] * cores):.0%}" if "pairs" in pure else ""
                key = f"pairs, {key.split('/')[1]} shards"
            else:
                thr = f"{m.get('sample_text_mb', 0):.0f} of {m.get('corpus_text_mb', 0):.0f} MB text"
                share = f"{pure[f'vocab_x{n}'] / r['seconds']:.0%}" if f"vocab_x{n}" in pure else ""
            task = r["task_title"].replace("ray::", "").split(" ")[0]
            killed = m.get("tasks_killed_for_memory", 0)
            print(f"| {label} | {key} | {r['seconds']:.1f} | {thr} | {share} | {r['node_mib']:.0f} "
                  f"| {r['ours_mib']:.0f} | {r['task_mib']:.0f} ({task}) | {killed:.0f} | {r['store_mib']:.0f} "
                  f"| {r['spilled_mib']:.0f} |")
    print("\n## Where pairs spends its time (wall s; CPU-s summed over tasks)")
    print("| corpus | shards | pass 1 wall | tokenize | pair | write parts | pass 2 wall (both lengths) | read cells "
          "| shuffle | write shards | cells (128, 512) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, res in results.items():
        for key, r in res.items():
            if not key.startswith("pairs"):
                continue
            m = r["metrics"]

            def both(name: str) -> float:
                return sum(v for k, v in m.items() if k.startswith(name) and k.endswith(("seq128", "seq512")))

            print(f"| x{n} | {key.split('/')[1]} | {m.get('pass1_seconds', 0):.1f} "
                  f"| {m.get('pass1_tokenize_s', 0):.1f} | {m.get('pass1_pair_s', 0):.1f} "
                  f"| {m.get('pass1_write_s', 0):.1f} | {m.get('pass2_seconds', 0):.1f} "
                  f"| {both('pass2_read_s_'):.1f} | {both('pass2_shuffle_s_'):.1f} | {both('pass2_write_s_'):.1f} "
                  f"| {m.get('cells_seq128', 0):.0f}, {m.get('cells_seq512', 0):.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10,30,300", help="xN corpora, comma-separated")
    ap.add_argument("--num-shards", default="4,4096",
                    help="pairs.num_shards to run pairs at (tiny's 4 and bert_large's 4,096); clean and vocab run once")
    ap.add_argument("--stages", default="clean,vocab,pairs",
                    help="the stages to run; the others' outputs must be in --keep DIR from an earlier run")
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--read-workers", type=int, default=0, help="clean.num_read_workers (0 = as many as CPUs)")
    ap.add_argument("--vocab-sample-mb", type=float, default=50.0,
                    help="vocab.max_sample_bytes in MB, scaled down with the corpus (the default is 300)")
    ap.add_argument("--split-mb", type=int, default=8,
                    help="clean.split_bytes in MB, scaled down with the corpus (the default, 128, suits full dumps)")
    ap.add_argument("--docs-per-pool", type=int, default=500,
                    help="pairs.docs_per_partition, scaled down with the corpus so blocks outnumber the CPUs")
    ap.add_argument("--max-task-mib", type=int, default=0, help="pairs.max_task_bytes in MiB (0: the default)")
    ap.add_argument("--workers-split-mb", type=int, default=3,
                    help="clean.split_bytes for the 1-vs-2-workers check: enough units that 2 workers stay balanced")
    ap.add_argument("--clean-workers-check", type=int, default=0,
                    help="xN dump to time clean with 1 vs 2 workers (0: skip)")
    ap.add_argument("--no-pure", action="store_true", help="skip the pure cores (shares left blank)")
    ap.add_argument("--keep", default="", help="build in this folder and keep it; dumps already there are used")
    ap.add_argument("--json", default="", help="write the raw results here")
    args = ap.parse_args()
    sizes_list = [int(x) for x in args.sizes.split(",")]
    args.num_shards = [int(x) for x in args.num_shards.split(",")]
    args.stages = args.stages.split(",")
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="bench_scale-"))
    tmp.mkdir(parents=True, exist_ok=True)
    sample = REPO / "data" / "sample" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    if not sample.is_file():
        sys.exit(f"{sample} is missing: run `bertpipe fetch-sample` first")
    try:
        t = time.perf_counter()
        wanted = sorted(set(sizes_list + ([args.clean_workers_check] if args.clean_workers_check else [])))
        dumps = {n: tmp / f"enwiki-x{n}-pages-articles-multistream.xml.bz2" for n in wanted}
        missing = [n for n, d in dumps.items() if not d.is_file()]
        if missing:
            dumps.update(build_dumps(sample, missing, tmp))
            print(f"built {len(missing)} dumps in {time.perf_counter() - t:.0f} s")
        results = {}
        for n in sizes_list:
            results[n] = run_stages(dumps[n], tmp / f"work-x{n}", args)
            if args.json:  # after every size: a long run's figures survive its interruption
                Path(args.json).write_text(json.dumps({"results": results}, indent=1))
        small = tmp / f"work-x{min(sizes_list)}"
        pure = {} if args.no_pure else {
            "clean": pure_clean(dumps[min(sizes_list)]),
            "pairs": pure_pairs(small / "clean", small / "vocab" / "vocab.txt", args.docs_per_pool),
            **{f"vocab_x{n}": pure_vocab(tmp / f"work-x{n}" / "clean", args.vocab_sample_mb, 12345)
               for n in sizes_list if "vocab" in args.stages}}
        report(results, pure, args.num_cpus, dumps)
        workers = clean_workers(dumps[args.clean_workers_check], tmp, args) if args.clean_workers_check else {}
        if args.json:
            Path(args.json).write_text(json.dumps({"results": results, "pure": pure, "workers": workers}, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def clean_workers(dump: Path, tmp: Path, args) -> dict[int, float]:
    """The clean stage on one multistream dump with 1 and with 2 read workers."""
    from bertpipe.jobs import workflow
    from bertpipe.jobs.config import load_config
    from bertpipe.pipeline.framework.stage import read_manifest

    out = {}
    for workers in (1, 2):
        cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [
            f"clean.input=[{dump}]", f"ray.num_cpus={args.num_cpus}", "ray.dashboard=false",
            "mlflow.tracking_uri=off", f"clean.num_read_workers={workers}",
            f"clean.split_bytes={args.workers_split_mb * 1_000_000}"],
            workdir=str(tmp / f"workers-{workers}"))
        workflow.run(cfg, only=["clean"], force=True)
        m = read_manifest(workflow.stage_uri(cfg, "clean"))
        out[workers] = m["metrics"]["mb_wikitext"] / m["seconds"]
    print(f"\nclean, {dump.name} ({dump.stat().st_size / 1e6:.0f} MB bz2, split_bytes {args.workers_split_mb} MB): "
          f"1 worker {out[1]:.1f} MB/s, 2 workers {out[2]:.1f} MB/s: {out[2] / out[1]:.2f}x")
    return out


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    main()
