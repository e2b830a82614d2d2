"""Pre-training checkpoints and the export, shared by the driver (which finds where a rerun resumes) and the
workers (which save, load and export).

A checkpoint is DeepSpeed's files (every rank's ZeRO shards) under the tag `ckpt`, plus `position.json`: where in
the data it was taken (phase, epoch, batch) so a resumed worker skips exactly the batches it had consumed.
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
from bertpipe.pipeline import storage

CKPT_TAG = "ckpt"
STATE_FILE = "position.json"
EXPORT_FILES = ("config.json", "model.safetensors", "vocab.txt")  # what fine-tuning (and transformers) loads


def _complete(ckpt: str, cfg: PretrainConfig) -> bool:
    """Every rank's DeepSpeed files are there (a crash mid-save leaves a partial folder)."""
    if cfg.zero_stage == 0:
        needed = ["mp_rank_00_model_states.pt"]
    else:
        needed = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(cfg.num_workers)]
    return all(storage.exists(storage.join(ckpt, CKPT_TAG, n)) for n in needed)


def _step_of(ckpt: str) -> int | None:
    try:
        return int(json.loads(storage.read_text(storage.join(ckpt, STATE_FILE)))["step"])
    except (OSError, ValueError, KeyError):
        return None


def latest_checkpoint(storage_path: str, name: str, cfg: PretrainConfig) -> str | None:
    """The complete checkpoint with the highest step under <storage_path>/<name>, or None.

    Ray Train V2 restores a rerun with the same (storage_path, name) from its snapshot, but a run that died right
    after reporting may not have written the snapshot yet; scanning the folders makes the rerun resume then too."""
    run_dir = storage.join(storage_path, name)
    if not storage.exists(run_dir):
        return None
    fs, path = storage.resolve(run_dir)
    best: tuple[int, str] | None = None
    for info in fs.get_file_info(pafs.FileSelector(path)):
        base = posixpath.basename(info.path)
        if info.type != pafs.FileType.Directory or not base.startswith("checkpoint_"):
            continue
        ckpt = storage.join(run_dir, base)
        step = _step_of(ckpt) if _complete(ckpt, cfg) else None
        if step is not None and (best is None or step > best[0]):
            best = (step, ckpt)
    return best[1] if best else None


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
        engine.save_checkpoint(d, tag=CKPT_TAG)
        with open(os.path.join(d, STATE_FILE), "w") as f:
            json.dump(position, f)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def load(engine, checkpoint) -> dict:
    """Restore engine, optimizer and scheduler state; returns the data position the checkpoint was taken at."""
    with checkpoint.as_directory() as d:
        engine.load_checkpoint(d, tag=CKPT_TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
        with open(os.path.join(d, STATE_FILE)) as f:
            return json.load(f)


def export(engine, vocab_bytes: bytes, export_uri: str, zero_stage: int, rank: int, run) -> None:
    """HF-layout export (model.safetensors + config.json + vocab.txt) to `export_uri` from rank 0, also logged to
    MLflow. Under ZeRO-3 every rank takes part in gathering the full parameters."""
    import deepspeed
    import torch.distributed as dist

    from bertpipe.model import save_pretrained

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None,
                                           enabled=zero_stage == 3):
        if rank == 0:
            with tempfile.TemporaryDirectory() as d:
                vocab_path = os.path.join(d, "vocab-source.txt")
                with open(vocab_path, "wb") as f:
                    f.write(vocab_bytes)
                export_dir = os.path.join(d, "export")
                save_pretrained(engine.module, export_dir, vocab_path)
                storage.upload_dir(export_dir, export_uri)
                run.log_artifacts(export_dir, "export")
    if dist.is_initialized():
        dist.barrier()
