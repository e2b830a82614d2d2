"""What a pre-training run is: the fields that change its result, not how it is laid out on the cluster.

A run's name (its folder under Ray Train's storage, where its checkpoints live) hashes the model's shape, the data
(the inputs' ids), the optimizer and schedule, the masking and the seed. The layout does not enter it: worker count,
CPUs, prefetching, activation checkpointing, logging / evaluation / checkpoint cadence, compile, retries, where
checkpoints are stored. So a rerun after a change of cadence or CPUs resumes the checkpoint, and a change of a
result field starts a new run, saying which field changed (`changes`). `pretrain.restart` asks for a new run of the
same identity: it gets the next `-r<N>` name, and later reruns resume that one.

A change of layout that moves where a checkpoint's state lives (another worker count under ZeRO 1-3: the optimizer
state is partitioned by it; another micro-batch: the data position is counted in micro-batches) is refused in one
line by `check_layout` rather than loaded wrongly: re-partitioning is not done yet.
"""
from __future__ import annotations

import json
import posixpath
import re
import time
from typing import Any

from bertpipe.jobs.configtools import stable_hash, to_dict
from bertpipe.pipeline.framework import storage

IDENTITY_FILE = "identity.json"  # in the run folder: the fields the name hashes, for `changes` to compare
# pretrain fields of the layout (placement, cadence, bookkeeping): never part of a run's identity.
LAYOUT = ("num_workers", "cpus_per_worker", "prefetch_batches", "log_every_steps", "eval_every_steps",
          "eval_max_batches", "checkpoint_every_steps", "num_checkpoints_to_keep", "max_failures", "compile",
          "offload_optimizer", "storage_path", "run_name", "restart")
PHASE_LAYOUT = ("micro_batch_size",)
MODEL_LAYOUT = ("activation_checkpointing",)


def identity(config: dict[str, Any], seed: int, inputs: dict[str, str]) -> dict[str, Any]:
    """The result fields of a stage config ({"model": ModelConfig, "pretrain": PretrainConfig}), with seed and
    inputs."""
    plain = {k: to_dict(v) for k, v in config.items()}
    model = {k: v for k, v in plain.get("model", {}).items() if k not in MODEL_LAYOUT}
    pretrain = {k: v for k, v in plain.get("pretrain", {}).items() if k not in LAYOUT}
    pretrain["phases"] = [{k: v for k, v in p.items() if k not in PHASE_LAYOUT} for p in pretrain.get("phases", [])]
    return {"model": model, "pretrain": pretrain, "seed": seed, "inputs": dict(sorted(inputs.items()))}


def base_name(ident: dict[str, Any]) -> str:
    return "pretrain-" + stable_hash(ident)[:12]


def run_folders(storage_path: str) -> list[str]:
    """The pre-training run folders under storage_path (names), sorted."""
    if not storage.exists(storage_path):
        return []
    import pyarrow.fs as pafs

    fs, path = storage.resolve(storage_path)
    return sorted(posixpath.basename(i.path) for i in fs.get_file_info(pafs.FileSelector(path))
                  if i.type == pafs.FileType.Directory and posixpath.basename(i.path).startswith("pretrain-"))


def choose_name(base: str, existing: list[str], restart: bool) -> str:
    """The run to use: the newest restart of this identity (`base`, `base-r2`, ...), or a new one with `restart`."""
    mine = [n for n in existing if n == base or re.fullmatch(re.escape(base) + r"-r\d+", n)]
    latest = max((int(n.rsplit("-r", 1)[1]) if n != base else 1 for n in mine), default=0)
    if restart:
        return f"{base}-r{latest + 1}" if latest else base
    return base if latest <= 1 else f"{base}-r{latest}"


def record(storage_path: str, name: str, ident: dict[str, Any]) -> None:
    """The run's identity in its folder, with the time: the newest one is what a changed config is compared to."""
    storage.write_text_atomic(storage.join(storage_path, name, IDENTITY_FILE),
                              json.dumps({"recorded_at": time.time(), "identity": ident}, indent=1))


def changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """"key: old → new" for every leaf that differs (inputs by name)."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        where = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += changes(a, b, where + ".")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(
                isinstance(x, dict) for x in a + b):
            for i, (x, y) in enumerate(zip(a, b)):
                out += changes(x, y, f"{where}[{i}].")
        elif a != b:
            out.append(f"{where} {_short(a)} → {_short(b)}")
    return out


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def previous_run(storage_path: str, name: str) -> tuple[str, dict[str, Any]] | None:
    """The newest other run folder with a recorded identity (the run a changed config no longer resumes)."""
    found = []
    for folder in run_folders(storage_path):
        if folder == name:
            continue
        try:
            recorded = json.loads(storage.read_text(storage.join(storage_path, folder, IDENTITY_FILE)))
            found.append((float(recorded["recorded_at"]), folder, recorded["identity"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not found:
        return None
    _, folder, ident = max(found)
    return folder, ident


def layout_of(num_workers: int, micro_batch_sizes: list[int], zero_stage: int) -> dict[str, Any]:
    return {"num_workers": num_workers, "micro_batch_sizes": list(micro_batch_sizes), "zero_stage": zero_stage}


def check_layout(then: dict[str, Any] | None, now: dict[str, Any], step: int) -> None:
    """ValueError in one line when a checkpoint taken with layout `then` cannot be loaded with `now`."""
    if not then:
        return
    problems = []
    if then["num_workers"] != now["num_workers"] and now["zero_stage"] >= 1:
        problems.append(f"{then['num_workers']} workers, now {now['num_workers']} (ZeRO {now['zero_stage']} "
                        "partitions the optimizer state by worker count)")
    if then["micro_batch_sizes"] != now["micro_batch_sizes"]:
        problems.append(f"micro-batches {then['micro_batch_sizes']}, now {now['micro_batch_sizes']} (the data "
                        "position is counted in micro-batches)")
    if problems:
        raise ValueError(f"pretrain: the step-{step} checkpoint of this run was taken with {'; '.join(problems)}: "
                         "resuming it on another layout is not supported yet; rerun with the checkpoint's layout, or "
                         "start this run again from step 0 with --set pretrain.restart=true")


def describe_layout(layout: dict[str, Any] | None) -> str:
    if not layout:
        return "unknown layout"
    return f"{layout['num_workers']} workers × micro {'/'.join(map(str, layout['micro_batch_sizes']))}"
