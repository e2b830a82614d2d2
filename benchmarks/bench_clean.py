"""Benchmark of the clean stage, side by side in one run on the same dump and the same cores.

1. Cleaning throughput, one process (= per core): our pure core vs WikiExtractor 3.1.0's in-process
   Extractor.clean_text (the tool behind the original BERT/NVIDIA corpora), on the articles of the enwiki sample
   replicated N times; rounds are interleaved and the best round counts, since the machine is shared.
2. Peak RSS of one clean worker (read + clean + write, as a Ray task runs it) on the sample replicated 1x and 20x
   with new page ids, written as new .bz2 dumps: it must stay flat as the dump grows.
3. Wall time of the whole stage on 2 files with 1 vs 2 Ray read workers.

    python benchmarks/bench_clean.py [--replicas 3] [--rounds 3] [--rss-replicas 1,20] [--skip-ray]
"""
from __future__ import annotations

import argparse
import bz2
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bertpipe.pipeline.stages.config import SAMPLE_DUMP
from bertpipe.pipeline.stages.dump_reader import iter_pages
from bertpipe.pipeline.stages.wikitext import strip_with_mwparser, wikitext_to_paragraphs

LEFTOVER = re.compile(r"\{\{|\}\}|\{\||\[\[|\]\]|==|<ref|Category:|File:|Image:|thumb\||^\s*[*#]", re.M)


def _wikiextractor(page) -> str:
    from wikiextractor.extract import Extractor

    # Default clean_text (expand_templates=True, but no template definitions loaded: they expand to nothing,
    # as in a run without --templates). Returns a list of lines.
    return "\n".join(Extractor(page.id, 0, "", page.title, []).clean_text(page.text))


def _wikiextractor_noexpand(page) -> str:
    from wikiextractor.extract import Extractor

    return "\n".join(Extractor(page.id, 0, "", page.title, []).clean_text(page.text, expand_templates=False))


def _ours(page) -> str:
    return "\n".join(wikitext_to_paragraphs(page.text))


def _mwparser(page) -> str:
    return strip_with_mwparser(page.text)


def throughput(dump: str, replicas: int, rounds: int) -> list[dict]:
    articles = [p for p in iter_pages(dump) if p.ns == 0 and not p.redirect] * replicas
    mb = sum(p.num_bytes for p in articles) / 1e6
    cleaners = {"ours (pipeline.stages.wikitext)": _ours, "wikiextractor 3.1.0 clean_text": _wikiextractor,
                "wikiextractor, expand_templates=False": _wikiextractor_noexpand}
    best = {name: float("inf") for name in cleaners}
    outputs = {}
    for _ in range(rounds):
        for name, fn in cleaners.items():
            t = time.perf_counter()
            outputs[name] = [fn(p) for p in articles]
            best[name] = min(best[name], time.perf_counter() - t)
    # The plain-parser reference is slow: one round on one replica.
    one = articles[: len(articles) // replicas]
    t = time.perf_counter()
    outputs["mwparserfromhell strip_code"] = [_mwparser(p) for p in one]
    best["mwparserfromhell strip_code"] = (time.perf_counter() - t) * replicas
    rows = []
    for name, seconds in best.items():
        out = outputs[name]
        rows.append({"cleaner": name, "mb_per_s": mb / seconds, "articles_per_s": len(articles) / seconds,
                     "x_vs_wikiextractor": best["wikiextractor 3.1.0 clean_text"] / seconds,
                     "out_mb": sum(len(o.encode()) for o in out) / 1e6 * (replicas if len(out) < len(articles) else 1),
                     "leftover_markup": sum(len(LEFTOVER.findall(o)) for o in out)
                     * (replicas if len(out) < len(articles) else 1)})
    print(f"\n## Cleaning throughput, 1 process, {len(articles)} articles = {mb:.1f} MB wikitext "
          f"(enwiki sample x{replicas}, best of {rounds} interleaved rounds)")
    print(f"{'cleaner':42} {'MB/s/core':>10} {'art/s/core':>11} {'x vs wx':>8} {'out MB':>8} {'markup left':>12}")
    for r in rows:
        print(f"{r['cleaner']:42} {r['mb_per_s']:10.2f} {r['articles_per_s']:11.1f} {r['x_vs_wikiextractor']:8.2f} "
              f"{r['out_mb']:8.2f} {r['leftover_markup']:12d}")
    return rows


def replicate_dump(src: str, dest: Path, copies: int) -> Path:
    """`src` with its pages repeated `copies` times, each copy with new page ids, written as a new .bz2."""
    xml = bz2.decompress(Path(src).read_bytes()).decode("utf-8")
    first, last = xml.index("  <page>"), xml.rindex("</page>") + len("</page>\n")
    header, body, footer = xml[:first], xml[first:last], xml[last:]
    compressor = bz2.BZ2Compressor(1)
    with open(dest, "wb") as f:
        f.write(compressor.compress(header.encode()))
        for k in range(copies):
            # The first <id> after <ns> is the page id; revision and contributor ids can stay.
            shifted = re.sub(r"(</ns>\s*<id>)(\d+)(</id>)",
                             lambda m: f"{m.group(1)}{int(m.group(2)) + k * 100_000_000}{m.group(3)}", body)
            f.write(compressor.compress(shifted.encode()))
        f.write(compressor.compress(footer.encode()))
        f.write(compressor.flush())
    return dest


_WORKER = """
import json, resource, sys, tempfile, time
from bertpipe.pipeline.stages.clean import clean_and_write_unit
t = time.perf_counter()
with tempfile.TemporaryDirectory() as out:
    r = clean_and_write_unit({"uri": sys.argv[1], "start": -1, "end": -1, "index": 0}, output_uri=out,
                             rows_per_file=20_000, max_page_bytes=4_000_000, pages_per_batch=64,
                             min_paragraph_chars=20, min_article_chars=200, skip_disambiguation=True)
rows = sum(v for k, v in r.items() if k.startswith("n_"))
print(json.dumps({"pages": rows, "seconds": time.perf_counter() - t,
                  "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def worker_rss(dump: str, replicas: list[int], tmp: Path) -> list[dict]:
    rows = []
    for n in replicas:
        path = replicate_dump(dump, tmp / f"enwiki-x{n}.xml.bz2", n)
        proc = subprocess.run([sys.executable, "-c", _WORKER, str(path)], capture_output=True, text=True, check=True)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r.update(replicas=n, dump_mb=path.stat().st_size / 1e6)
        rows.append(r)
    print("\n## Peak RSS of one clean worker (read + clean, 64-page batches) as the dump grows")
    print(f"{'replicas':>8} {'bz2 MB':>8} {'pages':>8} {'seconds':>8} {'peak RSS MB':>12}")
    for r in rows:
        print(f"{r['replicas']:8d} {r['dump_mb']:8.1f} {r['pages']:8d} {r['seconds']:8.1f} {r['max_rss_mb']:12.1f}")
    return rows


def ray_workers(dump: str, tmp: Path, copies: int) -> list[dict]:
    import ray

    from bertpipe.pipeline.stages.clean import run_stage
    from bertpipe.pipeline.stages.config import CleanConfig
    from bertpipe.pipeline.framework.stage import StageContext

    files = [replicate_dump(dump, tmp / f"part-{i}.xml.bz2", copies) for i in range(2)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for workers in (1, 2, 1, 2):
            cfg = CleanConfig(input=tuple(str(f) for f in files), num_read_workers=workers)
            ctx = StageContext(name="clean", output_uri=str(tmp / f"out-{workers}"), config={"clean": cfg}, seed=0,
                               inputs={})
            t = time.perf_counter()
            result = run_stage(ctx)
            rows.append({"workers": workers, "wall_s": time.perf_counter() - t, "articles": result.num_rows,
                         "mb_wikitext": result.metrics["mb_wikitext"]})
    finally:
        ray.shutdown()
    print(f"\n## Whole stage on 2 files (each the sample x{copies}), Ray with 2 CPUs, 1 vs 2 read workers")
    print(f"{'workers':>7} {'wall s':>8} {'articles':>9} {'MB wikitext':>12}")
    for r in rows:
        print(f"{r['workers']:7d} {r['wall_s']:8.1f} {r['articles']:9d} {r['mb_wikitext']:12.1f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", default=SAMPLE_DUMP)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rss-replicas", default="1,20")
    ap.add_argument("--ray-copies", type=int, default=4)
    ap.add_argument("--skip-ray", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("BERTPIPE_CACHE_DIR", tempfile.mkdtemp(prefix="bertpipe-cache-"))
    print(f"machine: {os.cpu_count()} CPUs visible, python {sys.version.split()[0]}")
    throughput(args.dump, args.replicas, args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        worker_rss(args.dump, [int(x) for x in args.rss_replicas.split(",")], Path(tmp))
        if not args.skip_ray:
            ray_workers(args.dump, Path(tmp), args.ray_copies)


if __name__ == "__main__":
    main()
