"""Pre-training checkpoint folders, shared by the driver (which finds where a rerun resumes) and the workers (which
save and load them).

A checkpoint is DeepSpeed's files (every rank's ZeRO shards) under the tag `ckpt`, plus `position.json`: where in
the data it was taken (resume.Position) and the layout it was taken with (runs.layout_of), so a resumed worker
skips exactly what it had consumed, and a checkpoint of another worker count is re-partitioned (repartition.py).
Checkpoints live under Ray Train's storage (`<workdir>/ray_results/<run name>` by default), outside the stage
folder, so rerunning the stage after a crash continues instead of starting over.
"""
from __future__ import annotations

import json
import os
import posixpath
import tempfile

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
    if layout["zero_stage"] == 0:
        needed = ["mp_rank_00_model_states.pt"]
    else:
        needed = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(layout["num_workers"])]
    return step if all(_whole(storage.join(ckpt, CKPT_TAG, n)) for n in needed) else None


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


def save_and_report(engine, position: dict, metrics: dict) -> None:
    """Every rank saves its own DeepSpeed files (ZeRO shards differ per rank); Ray merges them into one checkpoint."""
    import ray.train

    with tempfile.TemporaryDirectory() as d:
        save_dir(engine, d, position)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def save_dir(engine, d: str, position: dict) -> None:
    """This rank's DeepSpeed files and the position (with the layout: CheckpointManager.layout) into the folder
    `d`."""
    engine.save_checkpoint(d, tag=CKPT_TAG)
    with open(os.path.join(d, STATE_FILE), "w") as f:
        json.dump(position, f)


def load_checkpoint(engine, checkpoint, now: dict, local_rank: int) -> dict:
    """Restore engine, optimizer and scheduler state (re-partitioned when the checkpoint was taken on another
    number of workers under ZeRO 1-3: `now` is this layout); returns the checkpoint's position.json."""
    with checkpoint.as_directory() as d:
        return load_dir(engine, d, now, local_rank)


def load_dir(engine, d: str, now: dict, local_rank: int) -> dict:
    """`load` from a local folder (every rank calls it; `local_rank`: its rank on its node)."""
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
