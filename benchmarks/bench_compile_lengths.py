"""A compiled restart whose first micro-batch has another length than the run's first: does the cache the
checkpoint carries hit? Side by side, the product's forward (the sequence dimension dynamic from the first step:
jobs/pretrain/worker.py) and torch.compile left to specialize its first graph (`maybe_mark_dynamic` a no-op).

    .venv/bin/python benchmarks/bench_compile_lengths.py

Each row is two processes, each with an empty inductor cache directory (a fresh node): a cold one trains 3 steps of
4 micro-batches from a 32-token one on and writes its compile cache as a checkpoint would; a warm one loads that file
and trains 3 steps from a 24-token micro-batch on (a restart resumes wherever the data is). No Ray, one thread, the
tiny model (tests/test_step_path.py's set-up). Prints the table in benchmarks/README.md (issue 41, item 3).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ONE_PROCESS = """
import json, os, sys, time
sys.path.insert(0, {tests!r})
import torch
from torch._dynamo.utils import counters
import engine_helpers as eh
from test_step_path import config, train
from bertpipe.jobs.pretrain.checkpointing.compile_cache import CompileCache
from bertpipe.jobs.pretrain.data.masking import MaskingSpec, round_up
torch.set_num_threads(1)
from torch._inductor import cpp_builder
built = []  # the C++ libraries this process built (a fresh node whose cache was complete builds none)
_build = cpp_builder.CppBuilder.build
def counted_build(self):
    result = _build(self)
    built.append(os.path.basename(self.get_target_file_path()))
    return result
cpp_builder.CppBuilder.build = counted_build
if not {dynamic!r}:
    torch._dynamo.maybe_mark_dynamic = lambda *args, **kwargs: None
cache = CompileCache()
if {load!r}:
    cache.read({folder!r})
batches = eh.raw_batches(40, 4, 32)
padded = [round_up(max(len(r) for r in b["input_ids"]), MaskingSpec.pad_to_multiple_of) for b in batches]
start = padded.index({first})
batches, padded = (batches[start:] + batches[:start])[:12], (padded[start:] + padded[:start])[:12]
cfg = config(compile=True, max_steps=3, log_every_steps=3)
with eh.process_group():
    w = eh.worker(cfg)
    started = time.perf_counter()
    train(w, cfg, batches)
    seconds = time.perf_counter() - started + cache.load_s
wrote = cache.write({folder!r}) if not {load!r} else None
print(json.dumps({{"s": seconds, "graphs": counters["stats"]["unique_graphs"], "loaded": cache.loaded, "wrote": wrote,
                  "first": padded[0],
                  "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"],
                  "lengths": sorted(set(padded)), "built": built}}))
"""


def one_process(dynamic: bool, load: bool, folder: Path, first: int, cache_dir: Path) -> dict:
    """3 compiled steps from the first micro-batch padded to `first` tokens on, in a process whose inductor cache is
    `cache_dir`: after loading `folder`'s compile cache (`load`), or writing it there. Also the slow test's set-up
    (tests/test_fast_restarts.py)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(REPO / "tests")}
    code = ONE_PROCESS.format(tests=str(REPO / "tests"), dynamic=dynamic, load=load, folder=str(folder), first=first)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, dynamic in (("specialized first graph (torch.compile's default)", False),
                              ("dynamic from the first step (the product)", True)):
            folder = Path(tmp) / f"checkpoint-{dynamic}"
            folder.mkdir()
            cold = one_process(dynamic, False, folder, 32, Path(tmp) / f"node-a-{dynamic}")
            warm = one_process(dynamic, True, folder, 24, Path(tmp) / f"node-b-{dynamic}")
            rows[name] = {"cold": cold, "warm": warm}
    print("| forward | graphs compiled (cold) | cold: compile + 3 steps | warm, first batch of another length "
          "| warm / cold | warm's inductor cache | C++ libraries built, cold / warm |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        cold, warm = r["cold"], r["warm"]
        print(f"| {name} | {cold['graphs']} | {cold['s']:.1f} s | {warm['s']:.1f} s | {warm['s'] / cold['s']:.2f} "
              f"| {warm['hits']} hits, {warm['misses']} misses | {len(cold['built'])} / {len(warm['built'])} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
