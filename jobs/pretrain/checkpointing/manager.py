"""One worker's checkpoints, as torchtitan's CheckpointManager keeps them: which one a worker resumes from (the later
of Ray Train's and the newest complete one in the run folder), its load (re-partitioned when the worker count
changed: repartition.py), where the run goes on from it (resume.resume_plan), every save, and at the end the export
fine-tuning reads.

A checkpoint holds DeepSpeed's files, the position in the data, the layout it was taken with (runs.layout_of) and
the history of the curves (folders.py has the folder's format); the driver reads the same folders to say where a
rerun resumes (stage.py)."""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from bertpipe.jobs.pretrain import runs
from bertpipe.jobs.pretrain.checkpointing import folders
from bertpipe.jobs.pretrain.checkpointing.compile_cache import CompileCache
from bertpipe.jobs.pretrain.checkpointing.export import data_lowercase, write_export
from bertpipe.jobs.pretrain.checkpointing.resume import Position, position_of, resume_plan
from bertpipe.jobs.pretrain.engine.build import compile_enabled
from bertpipe.jobs.pretrain.worker_spec import WorkerSpec
from bertpipe.jobs.services.tracking import CHECKPOINT, RunLogger
from bertpipe.pipeline.framework import storage

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

log = logging.getLogger("bertpipe.pretrain")
UPLOAD_METRIC = f"{CHECKPOINT}upload_s"  # seconds of a checkpoint's upload to storage, at its step (rank 0's)


class CheckpointManager:
    def __init__(self, spec: WorkerSpec, engine: DeepSpeedEngine, rank: int, world: int, local_rank: int,
                 run: RunLogger | None = None):
        """`local_rank`: this worker's rank on its node (one rank a node converts a checkpoint of another layout);
        `run`: where rank 0 logs each upload's seconds."""
        self.spec, self.engine, self.rank, self.world, self.local_rank = spec, engine, rank, world, local_rank
        self.run = run or RunLogger(None)
        # torch.compile's cache travels with the checkpoints (compile_cache.py): None when not compiling
        cfg = spec.pretrain
        self.compile_cache = CompileCache() if compile_enabled(cfg) and cfg.compile_cache_in_checkpoint else None
        self.upload_s: float | None = None  # what the last finished upload took (a drain's checkpoint needs it)

    @property
    def layout(self) -> dict[str, Any]:
        """How this worker group lays a checkpoint's state out: what a resume on another layout must match
        (runs.check_layout)."""
        cfg = self.spec.pretrain
        return runs.layout_of(self.world, [p.micro_batch_size for p in cfg.phases], cfg.zero_stage,
                              cfg.num_workers if cfg.elastic else None)

    def latest(self) -> str | None:
        """The newest complete checkpoint in the run folder (None: none yet)."""
        return folders.latest_checkpoint(self.spec.storage_path, self.spec.run_name, self.spec.pretrain)

    def restore(self) -> tuple[Position, list[dict[str, float]]]:
        """(where this worker goes on, the curves so far): from the later of Ray Train's checkpoint (a retry, or a
        rerun it has a snapshot for) and the newest complete one in the run folder (a rerun after a crash, or a
        retry that starts before the controller registered the last reported checkpoint); from step 0 without one.
        Rank 0 decides, so every rank loads the same."""
        import ray.train

        given = ray.train.get_checkpoint()
        found = [self.latest() if self.rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        # The later of the two: a driver killed right after the workers saved leaves a complete checkpoint that Ray
        # Train's snapshot never registered.
        newest = folders.newer(given.path if given is not None else None, found[0])
        checkpoint = given if given is not None and newest == given.path else (
            ray.train.Checkpoint(newest) if newest else None)
        if checkpoint is None:
            return Position(), []
        state = self.load(checkpoint)
        return self.resumed_position(state), state.get("history", [])

    def load(self, checkpoint) -> dict[str, Any]:
        """Engine, optimizer and LR scheduler state from a Ray Train checkpoint, re-partitioned when it was taken on
        another number of workers under ZeRO 1-3, and the compile cache it carries; returns its position.json."""
        with checkpoint.as_directory() as d:
            state = folders.load_dir(self.engine, d, self.layout, self.local_rank)
            if self.compile_cache is not None:
                self.compile_cache.read(d)
        return state

    def resumed_position(self, state: dict[str, Any]) -> Position:
        """Where this worker goes on from a loaded checkpoint's position.json (`state`): where it was taken, or, if
        it was taken with another layout, where resume.resume_plan says (the driver said so in its resume line)."""
        then, now = state.get("layout"), self.layout
        taken = position_of(state, then or now)
        assert self.engine.global_steps == taken.step, (self.engine.global_steps, taken.step)
        goes_on = resume_plan(taken, then, now, self.spec.pretrain, self.spec.rows)
        log.info("rank %d resumed at %s%s", self.rank, taken,
                 f", goes on at {goes_on.position}" if goes_on.position != taken else "")
        return goes_on.position

    def save(self, position: Position, history: list[dict[str, float]], reported: dict[str, Any],
             wait_for_upload: bool = False) -> None:
        """A checkpoint of the engine, the position in the data, the layout and the curves so far, reported to Ray
        Train with the figures `reported` (every rank saves its own files; Ray merges them into one checkpoint).
        Training waits for the files' copy to local disk; their upload to storage goes on beside it (Ray Train's
        asynchronous upload, pretrain.async_checkpoint_upload) unless `wait_for_upload` (the last checkpoint, a
        drain's: nothing is left to overlap, and the upload must end before the node does)."""
        folder = tempfile.mkdtemp(prefix="bertpipe-checkpoint-")
        try:
            folders.save_dir(self.engine, folder, {**dataclasses.asdict(position), "history": history,
                                                   "layout": self.layout})
            if self.compile_cache is not None and self.rank == 0:
                self.compile_cache.write(folder)
            folders.report(folder, reported, self.spec.pretrain.async_checkpoint_upload and not wait_for_upload,
                           functools.partial(self._uploaded, position.step))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # (once reported, Ray Train removes it after the upload)
            raise

    def _uploaded(self, step: int, seconds: float) -> None:
        """Called when Ray Train's upload of the step-`step` checkpoint ended (in its upload thread if
        asynchronous)."""
        self.upload_s = seconds
        self.run.log_metrics({UPLOAD_METRIC: seconds}, step)

    def export(self, run: RunLogger) -> None:
        """The model in Hugging Face layout with its tokenizer files, where fine-tuning reads it (and as `run`'s
        artifacts); with the casing its shards were made with."""
        spec = self.spec
        write_export(self.engine, spec.vocab_bytes, spec.export_uri, spec.pretrain.zero_stage, self.rank, run,
                     data_lowercase(spec.heldout))

    def stop_for_good(self, reason: str) -> None:
        """Training stopped on purpose (a non-finite loss): the reason left for the driver in the run folder, not
        raised, since Ray Train would retry from the last checkpoint and meet the same NaN again. Every rank read
        the same all-reduced health at the same window, so all stop here together."""
        if self.rank == 0:
            storage.write_text_atomic(folders.stop_marker(self.spec.storage_path, self.spec.run_name),
                                      json.dumps({"reason": reason, "step": self.engine.global_steps}))
        dist.barrier()
