"""Where a restart's time goes, and what a checkpoint stalls training (issue 41 item 3), before and after: a compiled
pre-training on the multi-node rig (tests/multinode.py: a head with 1 CPU for the data and three 1-CPU worker
nodes), two workers; the node of one is killed (its raylet, kill -9) once a checkpoint is registered, and Ray Train
restarts both workers on the nodes left. Every worker process compiles into an empty inductor cache directory of
its own (compile_cache.FRESH_CACHE_ENV): each restart starts as on a fresh node.

    python benchmarks/bench_restart.py --json /tmp/restart.json

Variants (one run each): "before" = the compile cache left out of the checkpoints and the upload waited for
(pretrain.compile_cache_in_checkpoint=false, pretrain.async_checkpoint_upload=false); "after" = the defaults.
Printed per variant: the restart's parts (MLflow restart/*, logged by rank 0 at the attempt's first new step), the
first attempt's compile (the console's "model compiled in N s"), each checkpoint's stall and upload (MLflow
checkpoint/stall_s, checkpoint/upload_s), and the kill → first new step latency (the run log's progress lines).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "tests"))

VARIANTS = {"before": ["--set", "pretrain.compile_cache_in_checkpoint=false",
                       "--set", "pretrain.async_checkpoint_upload=false"],
            "after": []}
COLD = re.compile(r"model compiled in (\d+) s \(inductor cache: 0 hits")


def series(db: Path, name: str) -> list[tuple[int, float]]:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return sorted((p.step, p.value) for r in runs for p in client.get_metric_history(r.info.run_id, name))


def run_variant(name: str, inputs: Path, home: Path, args) -> dict:
    import os

    from bertpipe.jobs.pretrain.checkpointing.compile_cache import FRESH_CACHE_ENV
    from bertpipe.jobs.pretrain.metrics.restart import RESTART_METRICS
    from multinode import MultiNodeRay
    from test_elastic_multinode import first_step_after
    from test_multinode import Watched, _a_checkpoint_is_registered, pretrain_args
    from waiting import wait_until

    home.mkdir(parents=True)
    os.environ[FRESH_CACHE_ENV] = str(home / "inductor")  # before the rig starts: its nodes inherit it
    with MultiNodeRay(head_cpus=1, node_cpus=(1, 1, 1)) as rig:
        run = Watched(pretrain_args(inputs, "--set", f"ray.address={rig.address}",
                                    "--set", f"pretrain.max_steps={args.steps}", "--set", "pretrain.compile=true",
                                    "--set", f"pretrain.checkpoint_every_steps={args.checkpoint_every}",
                                    "--set", "pretrain.max_failures=3", "--set", "pretrain.log_every_steps=2",
                                    *VARIANTS[name], mlflow=True), home)
        try:
            wait_until(lambda: _a_checkpoint_is_registered(home / "w" / "ray_results"), "a registered checkpoint",
                       still_running=lambda: run.proc.poll() is None, why_stopped=run.text, poll_s=0.2)
            killed = rig.kill_train_node()
            code = run.finish(args.timeout)
        finally:
            if run.proc.poll() is None:
                run.proc.kill()
    if code != 0:
        raise SystemExit(f"the {name} run in {home} failed (exit {code}):\n{run.text()[-3000:]}")
    db = home / "w" / "mlflow.db"
    parts = {key: series(db, metric) for key, metric in RESTART_METRICS.items()}
    resumed_at = parts["total"][0][0] - 1
    cold = [int(m.group(1)) for m in map(COLD.search, run.text().splitlines()) if m]
    return {"restart": {k: v[0][1] for k, v in parts.items()}, "first_attempt_compile_s": cold[0] if cold else None,
            "stall_s": [v for _, v in series(db, "checkpoint/stall_s")],
            "upload_s": [v for _, v in series(db, "checkpoint/upload_s")],
            "kill_to_first_new_step_s": first_step_after(home, killed["at"], resumed_at) - killed["at"],
            "console": [line for line in run.text().splitlines() if "pretrain:" in line]}


def table(results: dict[str, dict]) -> str:
    from bertpipe.jobs.pretrain.metrics.restart import LABELS, PARTS

    names = list(results)
    rows = [("| | " + " | ".join(names) + " |"), "|---|" + "---|" * len(names)]
    for part in (*PARTS, "total"):
        rows.append(f"| restart: {LABELS.get(part, part)} (s) | "
                    + " | ".join(f"{results[n]['restart'][part]:.1f}" for n in names) + " |")
    rows.append("| kill → first new step (s) | " + " | ".join(f"{results[n]['kill_to_first_new_step_s']:.1f}"
                                                              for n in names) + " |")
    rows.append("| first attempt's compile, cold (s) | " + " | ".join(str(results[n]["first_attempt_compile_s"])
                                                                      for n in names) + " |")
    for key, label in (("stall_s", "checkpoint stall, median (s)"), ("upload_s", "checkpoint upload, median (s)")):
        rows.append(f"| {label} | " + " | ".join(f"{statistics.median(results[n][key]):.3f} "
                                                 f"({len(results[n][key])})" for n in names) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="before,after")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    from pretrain_helpers import make_inputs

    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        root = Path(tmp)
        make_inputs(root / "inputs", lengths=(32,), rows_per_shard=400, num_shards=2, heldout_rows=160)
        (root / "inputs" / "pairs" / "_MANIFEST.json").unlink()
        results = {}
        for name in args.variants.split(","):
            started = time.time()
            results[name] = run_variant(name, root / "inputs", root / name, args)
            print(f"{name}: {time.time() - started:.0f} s; " + json.dumps(
                {k: v for k, v in results[name].items() if k != "console"}), flush=True)
            print("\n".join(results[name]["console"]), flush=True)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
