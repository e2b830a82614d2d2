"""The data stages (clean -> vocab -> pairs) as the corpus grows: wall time, throughput, share of the pure core on
the same cores, peak driver RSS, peak object-store use and bytes spilled.

The corpus is the real enwiki sample replicated xN with new page ids, written as a multistream dump (bz2 streams
of 100 pages) with its index, as Wikimedia publishes them, so the clean stage reads one file with several
workers. The xN dumps share their replicas: the x100 file is built once (two processes compress replicas) and the
smaller ones are its first N replicas plus the footer. Everything lives in a temp folder, never in the repo.

Each stage runs through the workflow (`bertpipe.jobs.workflow.run(only=[stage])`) in this process, which is the
driver: a sampler thread records this process's RSS and the object store's use and spill (Ray's memory summary)
every 0.5 s. The pure cores run in this process on one core, on the x10 corpus (their throughput does not depend on
size): clean = `iter_pages` + `clean_pages_batch`, pairs = `encode_documents` + `pair_table` per pool at every
length, vocab = `train_vocab` on the same sample the stage drew. Share = stage throughput / (pure core per core x
cores used); for vocab (the Rust trainer is multi-threaded on both sides) share = pure seconds / stage seconds.

    python benchmarks/bench_scale.py [--sizes 10,30,100] [--num-cpus 2] [--vocab-sample-mb 50] [--split-mb 8]
                                     [--docs-per-pool 500] [--keep DIR] [--json FILE]
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


class Sampler:
    """Peak RSS of this process, peak object-store use and spilled MiB, sampled every 0.5 s."""

    def __init__(self):
        self.rss = self.store = 0.0
        self.spilled_start = self.spilled = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _store(self) -> tuple[float, float]:
        import ray
        from ray._private.internal_api import memory_summary

        if not ray.is_initialized():
            return 0.0, 0.0
        text = memory_summary(stats_only=True)
        used = re.search(r"Plasma memory usage (\d+) MiB", text)
        spilled = re.search(r"Spilled (\d+) MiB", text)
        return float(used.group(1)) if used else 0.0, float(spilled.group(1)) if spilled else 0.0

    def _loop(self) -> None:
        proc = psutil.Process()
        while not self._stop.is_set():
            self.rss = max(self.rss, proc.memory_info().rss / 2**20)
            try:
                used, spilled = self._store()
            except Exception:  # noqa: BLE001 - Ray starting or stopping: skip this sample
                used, spilled = 0.0, None
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


def run_stages(dump: Path, work: Path, args) -> dict[str, dict]:
    from bertpipe.jobs import workflow
    from bertpipe.jobs.config import load_config
    from bertpipe.pipeline.framework.stage import read_manifest

    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [
        f"clean.input=[{dump}]", f"ray.num_cpus={args.num_cpus}", "ray.dashboard=false", "mlflow.tracking_uri=off",
        "vocab.vocab_size=30522", f"vocab.max_sample_bytes={int(args.vocab_sample_mb * 1e6)}",
        "pairs.dupe_factor=10", "pairs.num_shards=8", "pairs.max_seq_lengths=[128, 512]",
        f"pairs.docs_per_partition={args.docs_per_pool}",
        f"clean.num_read_workers={args.read_workers}", f"clean.split_bytes={args.split_mb * 1_000_000}"],
        workdir=str(work))
    from bertpipe.jobs.cluster import ensure_ray

    ensure_ray("", args.num_cpus, False)  # started before the clock: Ray's start-up is not a stage's cost
    out = {}
    for stage in ("clean", "vocab", "pairs"):
        with Sampler() as s:
            workflow.run(cfg, only=[stage], force=True)
        m = read_manifest(workflow.stage_uri(cfg, stage))
        out[stage] = {"seconds": m["seconds"], "metrics": m["metrics"], "rss_mib": s.rss, "store_mib": s.store,
                      "spilled_mib": s.spilled_mib}
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
    from bertpipe.pipeline.stages.pairs import cached_tokenizers, encode_documents, pair_table
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
    print(f"\n## Pure cores (one process, x10 corpus): clean {pure['clean']:.1f} MB/s, pairs "
          f"{pure['pairs'] / 1e3:,.0f}k tokens/s; vocab: train_vocab on each size's sample; stages on {cores} CPUs")
    print("| corpus | stage | wall s | throughput | share of pure core | peak driver RSS MiB | peak object store MiB "
          "| spilled MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for n, res in results.items():
        label = f"x{n} ({sizes[n].stat().st_size / 1e6:.0f} MB bz2)"
        for stage, r in res.items():
            m = r["metrics"]
            if stage == "clean":
                rate = m["mb_wikitext"] / r["seconds"]
                thr, share = f"{rate:.1f} MB wikitext/s", rate / (pure["clean"] * cores)
            elif stage == "pairs":
                rate = m["tokens"] / r["seconds"]
                thr, share = f"{rate / 1e3:,.0f}k tokens/s", rate / (pure["pairs"] * cores)
            else:
                thr = f"{m.get('sample_text_mb', 0):.0f} of {m.get('corpus_text_mb', 0):.0f} MB text"
                share = pure[f"vocab_x{n}"] / r["seconds"]
            print(f"| {label} | {stage} | {r['seconds']:.1f} | {thr} | {share:.0%} | {r['rss_mib']:.0f} | "
                  f"{r['store_mib']:.0f} | {r['spilled_mib']:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10,30,100")
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--read-workers", type=int, default=0, help="clean.num_read_workers (0 = as many as CPUs)")
    ap.add_argument("--vocab-sample-mb", type=float, default=50.0,
                    help="vocab.max_sample_bytes in MB, scaled down with the corpus (the default is 300)")
    ap.add_argument("--split-mb", type=int, default=8,
                    help="clean.split_bytes in MB, scaled down with the corpus (the default, 128, suits full dumps)")
    ap.add_argument("--docs-per-pool", type=int, default=500,
                    help="pairs.docs_per_partition, scaled down with the corpus so blocks outnumber the CPUs")
    ap.add_argument("--workers-split-mb", type=int, default=3,
                    help="clean.split_bytes for the 1-vs-2-workers check: enough units that 2 workers stay balanced")
    ap.add_argument("--clean-workers-check", type=int, default=30, help="xN dump to time clean with 1 vs 2 workers")
    ap.add_argument("--keep", default="", help="build in this folder and keep it")
    ap.add_argument("--json", default="", help="write the raw results here")
    args = ap.parse_args()
    sizes_list = [int(x) for x in args.sizes.split(",")]
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="bench_scale-"))
    tmp.mkdir(parents=True, exist_ok=True)
    sample = REPO / "data" / "sample" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    if not sample.is_file():
        sys.exit(f"{sample} is missing: run `bertpipe fetch-sample` first")
    try:
        t = time.perf_counter()
        dumps = build_dumps(sample, sorted(set(sizes_list + [args.clean_workers_check])), tmp)
        print(f"built {len(dumps)} dumps in {time.perf_counter() - t:.0f} s")
        results = {n: run_stages(dumps[n], tmp / f"work-x{n}", args) for n in sizes_list}
        small = tmp / f"work-x{min(sizes_list)}"
        pure = {"clean": pure_clean(dumps[min(sizes_list)]),
                "pairs": pure_pairs(small / "clean", small / "vocab" / "vocab.txt", args.docs_per_pool),
                **{f"vocab_x{n}": pure_vocab(tmp / f"work-x{n}" / "clean", args.vocab_sample_mb, 12345)
                   for n in sizes_list}}
        report(results, pure, args.num_cpus, dumps)
        workers = clean_workers(dumps[args.clean_workers_check], tmp, args)
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
