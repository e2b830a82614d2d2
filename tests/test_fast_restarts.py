"""Restarts in seconds (issue 41 item 3): where a restart's time goes is measured and reported; torch.compile's
cache travels with the checkpoints, so workers on a fresh node hit it instead of compiling from scratch;
checkpoints are uploaded while training goes on, and a checkpoint an upload left short of a file is never resumed.

The parts and the checkpoint files on their own first; then the cache across processes (one process, no Ray: a
fresh inductor cache directory stands for a fresh node); then a real restart on the multi-node rig
(tests/multinode.py), every worker process compiling into a fresh cache directory of its own.
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from bertpipe.jobs.pretrain.checkpointing import compile_cache
from bertpipe.jobs.pretrain.checkpointing.folders import CKPT_TAG, STATE_FILE, deepspeed_files, survey
from bertpipe.jobs.pretrain.config import PretrainConfig
from bertpipe.jobs.pretrain.metrics import restart
from bertpipe.jobs.pretrain.attempt_clock import AttemptStamp

HERE = Path(__file__).resolve().parent


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_restart_s_parts_close_once_at_its_first_step_and_sum_to_its_total():
    clock = FakeClock()
    timing = restart.RestartClock(AttemptStamp(2, started_at=1000.0), entered_at=1004.0, now=clock)
    with timing.part("engine_setup"):
        clock.t += 3.0
    with timing.part("checkpoint_load"):
        clock.t += 2.0
    timing.move(0.5, "checkpoint_load", "compile")  # the compile cache, read with the checkpoint
    with timing.part("first_batch"):
        clock.t += 1.0
    timing.batch_ready(0.25)
    timing.batch_ready(9.0)  # a later micro-batch is no first batch
    clock.t += 6.0
    timing.add("compile", 6.0)
    clock.t += 1.0
    got = timing.first_step()
    assert got == {"worker_start": 4.0, "engine_setup": 3.0, "checkpoint_load": 1.5, "compile": 6.5,
                   "first_batch": 1.25, "total": 17.0}
    assert timing.first_step() is None and timing.is_restart
    timing.add("compile", 5.0)  # after the first step nothing moves
    assert timing.parts["compile"] == 6.5
    assert set(restart.metric_values(got)) == {"restart/worker_start_s", "restart/engine_setup_s",
                                              "restart/checkpoint_load_s", "restart/compile_s",
                                              "restart/first_batch_s", "restart/total_s"}
    assert restart.line(got, 23, 2, "inductor cache: 4 hits, 0 misses") == (
        "restart (attempt 2) reached step 23 in 17.0 s: worker start 4.0 s, DeepSpeed set-up 3.0 s, checkpoint load "
        "1.5 s, compile 6.5 s (inductor cache: 4 hits, 0 misses), first batch 1.2 s, rest 0.8 s")
    assert restart.line(got, 23, 2, worker_note="forked from the node's warm process").startswith(
        "restart (attempt 2) reached step 23 in 17.0 s: worker start 4.0 s (forked from the node's warm process), "
        "DeepSpeed set-up 3.0 s")
    first = restart.RestartClock(AttemptStamp(1, 1000.0), 1001.0, now=clock)
    assert not first.is_restart and restart.RestartClock(None, 0.0).first_step() is None


def test_a_checkpoint_an_upload_left_short_of_any_deepspeed_file_is_torn(tmp_path):
    import torch

    def layout(workers, zero):
        return {"num_workers": workers, "micro_batch_sizes": [4], "zero_stage": zero}

    assert deepspeed_files(layout(2, 0)) == ["mp_rank_00_model_states.pt"]
    assert deepspeed_files(layout(2, 1)) == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                             "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert len(deepspeed_files(layout(2, 3))) == 4 and "zero_pp_rank_1_mp_rank_00_model_states.pt" in \
        deepspeed_files(layout(2, 3))
    run = tmp_path / "run"
    for step, stamp in ((20, "10-00-00"), (40, "10-01-00")):
        ckpt = run / f"checkpoint_2026-11-27_{stamp}.000000"
        (ckpt / CKPT_TAG).mkdir(parents=True)
        (ckpt / STATE_FILE).write_text(json.dumps({"step": step, "layout": layout(2, 1)}))
        for name in deepspeed_files(layout(2, 1)):
            torch.save({"w": torch.zeros(100)}, ckpt / CKPT_TAG / name)
    newest = run / "checkpoint_2026-11-27_10-01-00.000000"
    assert survey(str(tmp_path), "run", PretrainConfig())[0] == str(newest)
    (newest / CKPT_TAG / "mp_rank_00_model_states.pt").unlink()  # the model's file not uploaded yet
    assert survey(str(tmp_path), "run", PretrainConfig()) == (str(run / "checkpoint_2026-11-27_10-00-00.000000"),
                                                             [str(newest)])


# One process compiles and saves the artifacts beside a checkpoint; a second, with a fresh empty inductor cache
# directory (a fresh node), loads them and compiles: every inductor graph is a cache hit, although its first batch
# has another length than the first one's had (a restart resumes wherever the data is). Processes of their own
# (benchmarks/bench_compile_lengths.py's, which measures the same with and without the product's dynamic length):
# dynamo's and inductor's in-memory caches cannot be emptied reliably within one.
_spec = importlib.util.spec_from_file_location("bench_compile_lengths",
                                               HERE.parent / "benchmarks" / "bench_compile_lengths.py")
compile_lengths = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compile_lengths)


@pytest.mark.slow  # two processes each compile the model on CPU: over 2 min beside another test on 2 cores
def test_the_compile_cache_beside_a_checkpoint_makes_a_fresh_node_hit_instead_of_compiling(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    cold = compile_lengths.one_process(True, False, checkpoint, 32, tmp_path / "node-a")
    assert cold["wrote"] and cold["misses"] > 0 and cold["hits"] == 0
    assert (checkpoint / compile_cache.CACHE_FILE).stat().st_size > 0
    # the restart resumes on a shorter micro-batch: padded to 24 tokens, not 32
    warm = compile_lengths.one_process(True, True, checkpoint, 24, tmp_path / "node-b")
    assert warm["first"] != cold["first"], (cold, warm)
    # every graph the warm process compiled was a hit
    assert warm["loaded"] and warm["hits"] > 0 and warm["misses"] == 0, (cold, warm)
    # and it built no C++ library: neither a kernel nor inductor's ISA probes (the cold one built both)
    assert any(b.endswith(".main.so") for b in cold["built"]) and any(
        b.endswith(".so") and not b.endswith(".main.so") for b in cold["built"]), cold["built"]
    assert not [b for b in warm["built"] if b.endswith(".so")], warm["built"]
    print(f"\ncompile and 3 steps (s): cold {cold['s']:.1f}, warm {warm['s']:.1f} (the cache's load included)")
    # (a damaged file loads nothing: test_the_compile_cache_file_carries_the_kernels_..., without a third compile)


# ------------------------------------------------------------------------------------------------------------------
# A real restart on the multi-node rig


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from pretrain_helpers import foreign_rig_inputs

    return foreign_rig_inputs(tmp_path_factory.mktemp("restart-inputs"))


def series(tmp_path, name: str) -> list[tuple[int, float]]:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'w' / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return sorted((p.step, p.value) for r in runs for p in client.get_metric_history(r.info.run_id, name))


# the restarted workers are forks of their nodes' warm processes (warm_start/), on the fresh nodes as elsewhere
RESTARTED = (r"pretrain: restart \(attempt 2\) reached step (\d+) in ([\d.]+) s: worker start [\d.]+ s \(forked from "
             r"the node's warm process\), DeepSpeed "
             r"set-up [\d.]+ s, checkpoint load [\d.]+ s, compile ([\d.]+) s \(inductor cache: (\d+) hits?, 0 misses, "
             r"loaded from the checkpoint\), first batch [\d.]+ s, rest [\d.]+ s$")


@pytest.mark.integration
@pytest.mark.rig
@pytest.mark.slow  # two cold compiles on two shared cores, the restart, a compile of the final evaluation: ~3-4 min
def test_a_restart_on_fresh_nodes_loads_the_compile_cache_and_says_where_its_time_went(inputs, tmp_path, monkeypatch):
    """Two compiled workers on two of three 1-CPU nodes, each worker process with an empty inductor cache directory
    of its own (a fresh node: tests/multinode.py's nodes share this machine's disk); the node of one is killed once
    a checkpoint is registered. The restarted workers load the cache the checkpoint carries and every inductor
    graph of their first step is a hit; rank 0 says where the restart's time went, and MLflow has the parts, each
    checkpoint's stall and upload."""
    from multinode import MultiNodeRay
    from test_multinode import Watched, _a_checkpoint_is_registered, pretrain_args
    from waiting import wait_until

    monkeypatch.setenv(compile_cache.FRESH_CACHE_ENV, str(tmp_path / "inductor"))  # the rig's nodes inherit it
    with MultiNodeRay(head_cpus=1, node_cpus=(1, 1, 1)) as rig:
        run = Watched(pretrain_args(inputs, "--set", f"ray.address={rig.address}", "--set", "pretrain.max_steps=40",
                                    "--set", "pretrain.compile=true", "--set", "pretrain.checkpoint_every_steps=10",
                                    "--set", "pretrain.max_failures=3", "--set", "pretrain.log_every_steps=2",
                                    mlflow=True), tmp_path)
        wait_until(lambda: _a_checkpoint_is_registered(tmp_path / "w" / "ray_results"), "a registered checkpoint",
                   still_running=lambda: run.proc.poll() is None, why_stopped=run.text, poll_s=0.2)
        rig.kill_train_node()
        code = run.finish(300)
    console = run.text()
    assert code == 0, console
    print("\n".join(line for line in console.splitlines() if "pretrain:" in line))
    cold = [m for m in (re.search(r"model compiled in \d+ s \(inductor cache: 0 hits, (\d+) misses\)$", line)
                        for line in console.splitlines()) if m]
    restarted = [m for m in (re.search(RESTARTED, line) for line in console.splitlines()) if m]
    # each said once: the first attempt's status is not told again after the driver's own restart line
    assert len(cold) == 1 and len(restarted) == 1, console
    assert int(restarted[0].group(4)) > 0 and int(cold[0].group(1)) > 0  # hits where the first attempt compiled
    first_step = int(restarted[0].group(1))
    parts = {name: series(tmp_path, name) for name in restart.RESTART_METRICS.values()}
    assert all(len(points) == 1 and points[0][0] == first_step and points[0][1] >= 0
               for points in parts.values()), parts
    total = parts["restart/total_s"][0][1]
    assert sum(points[0][1] for name, points in parts.items() if name != "restart/total_s") <= total + 1e-6
    assert parts["restart/compile_s"][0][1] > 0
    checkpoints = sorted(p for p in (tmp_path / "w" / "ray_results").rglob("checkpoint_*") if p.is_dir())
    # (the last one, uploaded before the run ended, and the one before it: an upload the kill cut may lack it)
    assert len(checkpoints) >= 2 and (checkpoints[-1] / compile_cache.CACHE_FILE).is_file() \
        and sum((c / compile_cache.CACHE_FILE).is_file() for c in checkpoints) >= 2, checkpoints
    stalls, uploads = series(tmp_path, "checkpoint/stall_s"), series(tmp_path, "checkpoint/upload_s")
    assert {s for s, _ in stalls} == {10, 20, 30} and all(v > 0 for _, v in stalls), stalls
    assert {10, 20, 30, 40} <= {s for s, _ in uploads} and all(v > 0 for _, v in uploads), uploads
    print(f"\nrestart breakdown (s): {({k.split('/')[1]: round(v[0][1], 2) for k, v in parts.items()})}; "
          f"stalls {[round(v, 3) for _, v in stalls]}, uploads {[round(v, 3) for _, v in uploads]}")


def test_how_checkpoints_upload_and_carry_the_compile_cache_is_layout_not_the_run_s_identity():
    from bertpipe.jobs.pretrain import runs
    from bertpipe.jobs.pretrain.config import ModelConfig

    def name(**pretrain):
        return runs.base_name(runs.identity({"model": ModelConfig(), "pretrain": PretrainConfig(**pretrain)}, 7, {}))

    assert name() == name(async_checkpoint_upload=False) == name(compile_cache_in_checkpoint=False)


def test_the_compile_cache_file_carries_the_kernels_to_their_place_and_refuses_a_damaged_one(tmp_path, monkeypatch):
    """The file's mechanics, without a compile: the kernels land where inductor looks for them in another cache
    directory, and a file cut short, or of artifacts PyTorch cannot read, loads nothing."""
    node_a, node_b, checkpoint = tmp_path / "a", tmp_path / "b", tmp_path / "checkpoint"
    kernel = node_a / "ns" / "cnsn75kernel.main.so"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"\x7fELF a built kernel")
    checkpoint.mkdir()
    # inductor's ISA probe, built beside the kernels; of these three only it is one
    (node_a / "pr").mkdir()
    (node_a / "pr" / "cprobe.cpp").write_text('extern "C" void __avx_chk_kernel() {}\n')
    (node_a / "pr" / "cnotprobe.main.cpp").write_text('extern "C" void __avx_chk_kernel() {}\n')
    (node_a / "pr" / "cbig.cpp").write_text('extern "C" void __avx_chk_kernel() {}\n' + "//\n" * 4096)
    for name in ("cprobe.so", "cnotprobe.main.so", "cbig.so"):
        (node_a / "pr" / name).write_bytes(b"\x7fELF " + name.encode())
    monkeypatch.setattr(compile_cache, "_loaded_kernels", lambda: {"ns/cnsn75kernel.main.so": str(kernel)})
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(node_a))
    cache = compile_cache.CompileCache()
    monkeypatch.setattr(cache, "artifacts", lambda: b"not PyTorch's artifacts")
    assert cache.write(str(checkpoint)) and (checkpoint / compile_cache.CACHE_FILE).is_file()
    assert not list(checkpoint.glob(".*"))  # (written under a temporary name, then renamed)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(node_b))
    other = compile_cache.CompileCache()
    assert not other.read(str(checkpoint))  # PyTorch cannot read those artifacts: nothing counts as loaded
    assert (node_b / "ns" / "cnsn75kernel.main.so").read_bytes() == kernel.read_bytes()
    assert (node_b / "pr" / "cprobe.so").read_bytes() == (node_a / "pr" / "cprobe.so").read_bytes()
    assert sorted(p.name for p in (node_b / "pr").iterdir()) == ["cprobe.so"]
    blob = (checkpoint / compile_cache.CACHE_FILE).read_bytes()
    (checkpoint / compile_cache.CACHE_FILE).write_bytes(blob[:-10])
    (node_b / "ns" / "cnsn75kernel.main.so").unlink()
    assert not compile_cache.CompileCache().read(str(checkpoint))
    assert not (node_b / "ns" / "cnsn75kernel.main.so").exists()  # a damaged file puts nothing in place
    assert not compile_cache.CompileCache().read(str(tmp_path / "no-checkpoint-here"))
