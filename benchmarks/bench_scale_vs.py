"""The data stages of this checkout against a reference checkout (another commit, its own venv), side by side in
one run, on the same replicated dump: issue 31 item 5 (what per-file bookkeeping costs the clean and pairs stages).

Each side runs in its own process with its own interpreter (`<tree>/.venv/bin/python`), alternating sides each
round so that a load change on the machine falls on both; each stage's wall is timed around `workflow.run(only=
[stage])` in the driver (Ray started before the clock), so what the stage does before and after its Ray Data job
(listing, checksums, locks, manifests) counts. Beside the wall, the CPU seconds of the driver's process tree (Ray and
its workers): on a machine other work shares, the wall moves with the load, the CPU a stage needs much less. The
table gives each side's median and the ratio (this / ref).

    python benchmarks/bench_scale_vs.py --ref /path/to/checkout-of-3c5261c [--size 30] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("clean", "vocab", "pairs")

# Run inside one side's interpreter, with that tree's workflow. The overrides are spelled out here rather than taken
# from each tree's bench_scale.run_stages: both sides must run the same settings whatever their defaults were then.
_SIDE = r"""
import json, sys, time
from pathlib import Path
import psutil
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import bench_scale
from bertpipe.jobs import workflow
from bertpipe.jobs.cluster import ensure_ray
from bertpipe.jobs.config import load_config
from bertpipe.pipeline.framework.stage import read_manifest

dump, work, cpus = Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
cfg = load_config(str(bench_scale.REPO / "configs" / "tiny.yaml"), [
    f"clean.input=[{dump}]", f"ray.num_cpus={cpus}", "ray.dashboard=false", "mlflow.tracking_uri=off",
    "vocab.vocab_size=30522", "vocab.max_sample_bytes=50000000", "pairs.dupe_factor=10", "pairs.num_shards=8",
    "pairs.max_seq_lengths=[128, 512]", "pairs.docs_per_partition=500", "clean.num_read_workers=0",
    "clean.split_bytes=8000000"], workdir=str(work))
ensure_ray("", cpus, False)


def tree_cpu():
    # this process and every process below it (Ray's and its workers); a reaped child's time is in its parent's
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


out = {}
for stage in ("clean", "vocab", "pairs"):
    t, cpu = time.perf_counter(), tree_cpu()
    workflow.run(cfg, only=[stage], force=True)
    wall, cpu = time.perf_counter() - t, tree_cpu() - cpu
    m = read_manifest(workflow.stage_uri(cfg, stage))
    out[stage] = {"wall": wall, "cpu": cpu, "manifest_seconds": m["seconds"], "metrics": m["metrics"]}
print("RESULT " + json.dumps(out))
"""


def run_side(tree: Path, dump: Path, work: Path, cpus: int) -> dict:
    python = tree / ".venv" / "bin" / "python"
    done = subprocess.run([str(python), "-c", _SIDE, str(tree), str(dump), str(work), str(cpus)], cwd=tree,
                          capture_output=True, text=True)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not line:
        sys.exit(f"{tree}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT "):])


def rate(stage: str, r: dict) -> float:
    m = r["metrics"]
    return m["mb_wikitext"] / r["wall"] if stage == "clean" else m.get("tokens", 0) / r["wall"] if stage == "pairs" \
        else 1 / r["wall"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", required=True, help="a checkout of the reference commit with its own .venv")
    ap.add_argument("--size", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--keep", default="", help="build the dump here and keep it (reused when present)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_scale

    tmp = Path(args.keep or tempfile.mkdtemp(prefix="bench_scale_vs-"))
    tmp.mkdir(parents=True, exist_ok=True)
    dump = tmp / f"enwiki-x{args.size}-pages-articles-multistream.xml.bz2"
    if not dump.is_file():
        sample = REPO / "data" / "sample" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
        dump = bench_scale.build_dumps(sample, [args.size], tmp)[args.size]
    sides = {"this": REPO, "ref": Path(args.ref).resolve()}
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for i in range(args.rounds):
        for name in (sides if i % 2 == 0 else reversed(list(sides))):
            runs[name].append(run_side(sides[name], dump, tmp / f"work-{name}", args.num_cpus))
            r = runs[name][-1]
            print(f"round {i + 1} {name}: " + ", ".join(f"{s} {r[s]['wall']:.1f} s ({r[s]['cpu']:.1f} CPU s)"
                                                        for s in STAGES)
                  + f" ({r['clean']['metrics']['mb_wikitext']:.1f} MB wikitext, {r['pairs']['metrics']['tokens']:,} "
                  "tokens)", flush=True)
    print(f"\n| x{args.size}, {args.num_cpus} CPUs, median of {args.rounds} | this wall s | ref wall s | this rate | "
          "ref rate | rate this/ref | this CPU s | ref CPU s | CPU this/ref |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in STAGES:
        walls = {k: statistics.median(r[s]["wall"] for r in v) for k, v in runs.items()}
        rates = {k: statistics.median(rate(s, r[s]) for r in v) for k, v in runs.items()}
        unit = {"clean": "MB wikitext/s", "pairs": "tokens/s", "vocab": "runs/s"}[s]
        cpus = {k: statistics.median(r[s]["cpu"] for r in v) for k, v in runs.items()}
        print(f"| {s} | {walls['this']:.1f} | {walls['ref']:.1f} | {rates['this']:,.1f} {unit} | "
              f"{rates['ref']:,.1f} | {rates['this'] / rates['ref']:.2f} | {cpus['this']:.1f} | {cpus['ref']:.1f} | "
              f"{cpus['this'] / cpus['ref']:.2f} |")


if __name__ == "__main__":
    main()
