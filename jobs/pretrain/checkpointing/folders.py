"""Pre-training checkpoint folders, shared by the driver (which finds where a rerun resumes) and the workers (which
save and load them).

A checkpoint is DeepSpeed's files (every rank's ZeRO shards) under the tag `ckpt`, plus `position.json`: where in
the data it was taken (resume.Position) and the layout it was taken with (runs.layout_of), so a resumed worker
skips exactly what it had consumed, and a checkpoint of another worker count is re-partitioned (repartition.py).
With compile, rank 0 adds torch.compile's cache artifacts (compile_cache.py), which no completeness check needs.
Checkpoints live under Ray Train's storage (`<workdir>/ray_results/<run name>` by default), outside the stage
folder, so rerunning the stage after a crash continues instead of starting over.
"""
from __future__ import annotations

import json
import os
import posixpath
import time
from typing import Callable

import pyarrow.fs as pafs

from bertpipe.jobs.pretrain.config import PretrainConfig
from bertpipe.pipeline.framework import storage

CKPT_TAG = "ckpt"
STATE_FILE = "position.json"


def _complete_step(ckpt: str, cfg: PretrainConfig) -> int | None:
    """The checkpoint's step if it is complete, else None: every rank's DeepSpeed files are there and whole (a crash
    mid-save leaves a folder without some, or with one cut short), and so is the position. Every rank of the layout
    the checkpoint was taken with (its position.json; one without a layout: this config's)."""
    state = state_of(ckpt)
    step = _step(state)
    if step is None:
        return None
    layout = state.get("layout") or {"num_workers": cfg.max_workers, "zero_stage": cfg.zero_stage}
    return step if all(_whole(storage.join(ckpt, CKPT_TAG, n)) for n in deepspeed_files(layout)) else None


def deepspeed_files(layout: dict) -> list[str]:
    """The DeepSpeed files a checkpoint of `layout` holds: the model's (rank 0's; every rank's under ZeRO-3) and,
    under ZeRO 1-3, every rank's optimizer partition. An upload cut short can leave out any of them (the
    asynchronous one goes on while training does)."""
    ranks, zero = range(layout["num_workers"]), layout["zero_stage"]
    if zero == 3:
        models = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks]
    else:
        models = ["mp_rank_00_model_states.pt"]
    return models + ([f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in ranks] if zero else [])


def state_of(ckpt: str) -> dict | None:
    """A checkpoint's position.json (resume.Position's fields, its layout, the curves so far); None if unreadable."""
    try:
        state = json.loads(storage.read_text(storage.join(ckpt, STATE_FILE)))
        return state if isinstance(state, dict) else None
    except (OSError, ValueError):
        return None


def _step(state: dict | None) -> int | None:
    try:
        return int(state["step"]) if state is not None else None
    except (KeyError, TypeError, ValueError):
        return None


def _whole(uri: str) -> bool:
    """torch.save writes a zip whose directory is at its end: a file cut short has none (one ranged read)."""
    import zipfile

    try:
        fs, path = storage.resolve(uri)
        with fs.open_input_file(path) as f:
            return zipfile.is_zipfile(f)
    except (OSError, ValueError):
        return False


def step_of(ckpt: str) -> int | None:
    return _step(state_of(ckpt))


def latest_checkpoint(storage_path: str, name: str, cfg: PretrainConfig) -> str | None:
    """The complete checkpoint with the highest step under <storage_path>/<name>, or None.

    Ray Train V2 restores a rerun with the same (storage_path, name) from its snapshot, but a run that died right
    after reporting may not have written the snapshot yet; scanning the folders makes the rerun resume then too."""
    return survey(storage_path, name, cfg)[0]


def survey(storage_path: str, name: str, cfg: PretrainConfig) -> tuple[str | None, list[str]]:
    """(the newest complete checkpoint or None, the checkpoint folders newer than it that are not complete: what
    a crash mid-save left). Newer means a later folder name: Ray Train names them by the time they were taken."""
    run_dir = storage.join(storage_path, name)
    if not storage.exists(run_dir):
        return None, []
    fs, path = storage.resolve(run_dir)
    found = sorted(posixpath.basename(info.path) for info in fs.get_file_info(pafs.FileSelector(path))
                   if info.type == pafs.FileType.Directory and posixpath.basename(info.path).startswith("checkpoint_"))
    best: tuple[int, str] | None = None
    for base in found:
        ckpt = storage.join(run_dir, base)
        step = _complete_step(ckpt, cfg)
        if step is not None and (best is None or step > best[0]):
            best = (step, ckpt)
    torn = [storage.join(run_dir, b) for b in found
            if best is None or b > posixpath.basename(best[1])]
    return (best[1] if best else None), [t for t in torn if _complete_step(t, cfg) is None]


def newer(a: str | None, b: str | None) -> str | None:
    """Of two checkpoint folders of one run, the later taken (Ray Train's folder names sort by time)."""
    if a is None or b is None:
        return a or b
    return a if posixpath.basename(a.rstrip("/")) >= posixpath.basename(b.rstrip("/")) else b


STOPPED_FILE = "stopped.json"  # why the workers stopped training on purpose (a non-finite loss), for the driver


def stop_marker(storage_path: str, name: str) -> str:
    return storage.join(storage_path, name, STOPPED_FILE)


def take_stop_reason(storage_path: str, name: str) -> str:
    """The reason the workers left in the run folder, removed as it is read ('' when they finished normally)."""
    marker = stop_marker(storage_path, name)
    if not storage.exists(marker):
        return ""
    reason = json.loads(storage.read_text(marker))["reason"]
    storage.delete_file(marker)
    return reason


def report(folder: str, metrics: dict, asynchronous: bool, uploaded: Callable[[float], None]) -> None:
    """This rank's checkpoint files in the local `folder` (removed once uploaded) reported to Ray Train with
    `metrics`; Ray merges every rank's into one checkpoint folder and registers it once all are uploaded. With
    `asynchronous`, Ray Train uploads them in a thread of its own while training goes on (in order, one at a time);
    otherwise the call returns after the upload. `uploaded(seconds)` gets what the upload took, when it ends."""
    import ray.train
    from ray.train import CheckpointUploadMode

    mode = CheckpointUploadMode.ASYNC if asynchronous else CheckpointUploadMode.SYNC
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder), checkpoint_upload_mode=mode,
                     delete_local_checkpoint_after_upload=True, checkpoint_upload_fn=_timed_upload(uploaded))


def _timed_upload(uploaded: Callable[[float], None]):
    """Ray Train's own upload (the copy into the run's storage), timed."""
    def upload(checkpoint, name: str):
        from ray.train.v2._internal.execution.context import get_train_context

        started = time.perf_counter()
        persisted = get_train_context().storage_context.persist_current_checkpoint(checkpoint, name)
        uploaded(time.perf_counter() - started)
        return persisted

    return upload


def save_dir(engine, d: str, position: dict) -> None:
    """This rank's DeepSpeed files and the position (with the layout: CheckpointManager.layout) into the folder
    `d`."""
    engine.save_checkpoint(d, tag=CKPT_TAG)
    with open(os.path.join(d, STATE_FILE), "w") as f:
        json.dump(position, f)


def load_dir(engine, d: str, now: dict, local_rank: int) -> dict:
    """Restore engine, optimizer and scheduler state from the local checkpoint folder `d` (re-partitioned when it
    was taken on another number of workers under ZeRO 1-3: `now` is this layout; every rank calls it,
    `local_rank`: its rank on its node); returns the checkpoint's position.json."""
    from bertpipe.jobs.pretrain.checkpointing import repartition
    from bertpipe.jobs.pretrain.checkpointing.resume import repartition_needed

    with open(os.path.join(d, STATE_FILE), "rb") as f:
        raw = f.read()
    state = json.loads(raw)
    if repartition_needed(state.get("layout"), now):
        repartition.load_repartitioned(engine, d, CKPT_TAG, raw, local_rank)
    else:
        engine.load_checkpoint(d, tag=CKPT_TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
    return state
