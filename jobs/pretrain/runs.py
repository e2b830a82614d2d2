"""What a pre-training run is: the fields that change its result, not how it is laid out on the cluster.

A run's name (its folder under Ray Train's storage, where its checkpoints live) hashes the model's shape, the data
(the inputs' ids), the optimizer and schedule, the masking and the seed. The layout does not enter it: worker count,
CPUs, prefetching, activation checkpointing, logging / evaluation / checkpoint cadence, compile, retries, where
checkpoints are stored. So a rerun after a change of cadence or CPUs resumes the checkpoint, and a change of a
result field starts a new run, saying which field changed (`changes`). `pretrain.restart` asks for a new run of the
same identity: it gets the next `-r<N>` name, and later reruns resume that one.

A change of layout that moves where a checkpoint's state lives is resumed all the same: another worker count under
ZeRO 1-3 loads the optimizer state re-partitioned (repartition.py), and the data position goes on by the rule of
resume.py (another micro-batch: exactly; another worker count: with the next epoch). `check_layout` refuses, in one
line, only what cannot be converted: a checkpoint of another ZeRO stage (reachable only with `pretrain.run_name`,
since the stage is part of the identity).
"""
from __future__ import annotations

import json
import posixpath
import re
import time
from typing import Any

from bertpipe.jobs.services.configtools import stable_hash, to_dict
from bertpipe.pipeline.framework import storage

IDENTITY_FILE = "identity.json"  # in the run folder: the fields the name hashes, for `changes` to compare
# pretrain fields of the layout (placement, cadence, bookkeeping): never part of a run's identity.
LAYOUT = ("num_workers", "cpus_per_worker", "prefetch_batches", "log_every_steps", "eval_every_steps",
          "eval_max_batches", "checkpoint_every_steps", "num_checkpoints_to_keep", "max_failures", "compile",
          "offload_optimizer", "storage_path", "run_name", "restart", "async_checkpoint_upload",
          "compile_cache_in_checkpoint", "warm_worker_start")
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


def record(storage_path: str, name: str, ident: dict[str, Any], start: dict[str, Any] | None = None) -> None:
    """The run's identity in its folder, with the time: the newest one is what a changed config is compared to;
    and what its latest start started from (stage.start_record), for `bertpipe status`."""
    storage.write_text_atomic(storage.join(storage_path, name, IDENTITY_FILE),
                              json.dumps({"recorded_at": time.time(), "identity": ident,
                                          **({"start": start} if start else {})}, indent=1))


def latest_start(storage_path: str, name: str = "") -> dict[str, Any] | None:
    """The start record of run `name` under storage_path, or (no name) of the run started last there; None if
    none was recorded."""
    found = []
    for folder in [name] if name else run_folders(storage_path):
        try:
            recorded = json.loads(storage.read_text(storage.join(storage_path, folder, IDENTITY_FILE)))
            if isinstance(recorded.get("start"), dict):
                found.append((float(recorded["recorded_at"]), folder, recorded["start"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    if not found:
        return None
    _, folder, start = max(found, key=lambda f: (f[0], f[1]))
    return {**start, "run": folder}


def describe_start(start: dict[str, Any], prefix: str = "pretrain: ") -> str:
    """A start record (stage.start_record) in one line: the console's at the start, and `bertpipe status`'s."""
    if start.get("checkpoint"):
        return (f"{prefix}resuming from the step-{start['resumed_from_step']} checkpoint {start['checkpoint']} "
                f"(taken with {describe_layout(start.get('layout_then'))}; now {describe_layout(start['layout_now'])};"
                f" the run started from {start['started_from']}): {start['carries']}")
    return f"{prefix}training starts at step 0 from {start['started_from']} ({start['why']})"


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


def layout_of(num_workers: int, micro_batch_sizes: list[int], zero_stage: int,
              elastic: tuple[int, int] | None = None) -> dict[str, Any]:
    """`elastic`: the range of an elastic run (its data is read in the shared order: data/shared_order.py)."""
    layout = {"num_workers": num_workers, "micro_batch_sizes": list(micro_batch_sizes), "zero_stage": zero_stage}
    return {**layout, "elastic": list(elastic)} if elastic else layout


def check_layout(then: dict[str, Any] | None, now: dict[str, Any], step: int) -> None:
    """ValueError in one line when a checkpoint taken with layout `then` cannot be loaded with `now`: only another
    ZeRO stage (another worker count or micro-batch is converted: repartition.py, resume.py)."""
    if then and then["zero_stage"] != now["zero_stage"]:
        raise ValueError(f"pretrain: the step-{step} checkpoint of this run was taken under ZeRO {then['zero_stage']}, "
                         f"now ZeRO {now['zero_stage']}: a checkpoint is converted to another worker count or "
                         "micro-batch, not to another ZeRO stage (its optimizer files differ: ZeRO 0 keeps none per "
                         f"rank); rerun with zero_stage {then['zero_stage']}, or start from step 0 under another "
                         "pretrain.run_name")


def describe_layout(layout: dict[str, Any] | None) -> str:
    if not layout:
        return "unknown layout"
    n, micro = layout["num_workers"], "/".join(map(str, layout["micro_batch_sizes"]))
    if layout.get("elastic"):
        return f"{layout['elastic'][0]}-{layout['elastic'][1]} workers (elastic) × micro {micro}"
    return f"{n} worker{'s' if n != 1 else ''} × micro {micro}"
