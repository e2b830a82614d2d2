"""The per-worker training function of pre-training (runs inside each Ray Train worker), as named steps.

One DeepSpeed engine per worker (engine/build.py) trains through the phases (seq 128, then 512) on its share of the
shards (data/streams.py), masking each batch on the fly. The position in the data is (phase, epoch, sequences of the
epoch trained: checkpointing/resume.Position): a checkpoint stores it, and a resumed worker re-reads the epoch and
drops the batches it had already consumed without collating them — with per-batch mask generators and a per-batch
dropout seed the resumed run computes exactly what an uninterrupted run computes. Where the worker resumes from, and
how a checkpoint of another layout goes on, is its checkpoint manager's (checkpointing/manager.py); what each step
costs, the logging window, the curves and the ETA are its metrics' (metrics/training_metrics.py): the loop marks
where a step ends and what it sets aside, and reads nothing itself.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from bertpipe.jobs.pretrain import drain
from bertpipe.jobs.pretrain.attempt_clock import attempt_stamp
from bertpipe.jobs.pretrain.checkpointing.compile_cache import fresh_cache_dir_if_asked
from bertpipe.jobs.pretrain.checkpointing.resume import Position
from bertpipe.jobs.pretrain.data.shared_order import SHARED, sequences_through
from bertpipe.jobs.pretrain.data.masking import batch_rng, mask_batch, seed_of
from bertpipe.jobs.pretrain.engine.build import build_engine, compile_enabled
from bertpipe.jobs.pretrain.engine.lamb_layout import mapped_layouts
from bertpipe.jobs.pretrain.evaluation import evaluate_heldout, time_eval_batches
from bertpipe.jobs.pretrain.metrics.meter import NonFiniteError
from bertpipe.jobs.pretrain.metrics.restart import RestartClock
from bertpipe.jobs.pretrain.warm_start.zygote import warm_start_note
from bertpipe.jobs.pretrain.worker import Worker, forward, masking_spec, to_device
from bertpipe.jobs.pretrain.worker_spec import WorkerSpec
from bertpipe.jobs.services.tracking import RunLogger

log = logging.getLogger("bertpipe.pretrain")


def train_loop_per_worker(config: dict[str, Any]) -> None:
    w = setup(config["spec"], time.time())
    clock = w.metrics.restart  # where this attempt's start goes, to its first step (metrics/restart.py)
    with clock.part("checkpoint_load"):
        position, history = w.checkpoints.restore()
    cache = w.checkpoints.compile_cache
    if cache is not None:  # read with the checkpoint, but a price of compiling
        clock.move(cache.load_s, "checkpoint_load", "compile")
    w.metrics.history = history
    w.metrics.attempt_started(position.step, accumulation_of(w, position.phase))  # the driver's attempt watch
    # tells a restart and a resize by it
    with clock.part("first_batch"):  # (its first micro-batch adds the rest: TrainingMetrics.micro_batch)
        w.data.open_all(position, w.doing)
    time_eval_batches(w)  # with the streams open: timed as the machine will be during training
    resumed_from = position.step
    try:
        position = train(w, position)
    except NonFiniteError as exc:
        w.checkpoints.stop_for_good(str(exc))
        w.metrics.run.flush_metrics()
        return
    final = final_evaluation(w, position, resumed_from)
    export_model(w)
    save_last_checkpoint(w, position, final)
    w.metrics.run.flush_metrics()  # the points still buffered, with a bounded wait (mlflow.flush_timeout_s)


def setup(spec: WorkerSpec, entered_at: float) -> Worker:
    """The worker's parts; `entered_at`: time.time() when the train function started (its attempt's clock)."""
    import ray.train
    import ray.train.torch

    cfg = spec.pretrain
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.cpus_per_worker)
    fresh_cache_dir_if_asked()
    clock = RestartClock(attempt_stamp(), entered_at)
    clock.worker_note = warm_start_note()
    if rank == 0:  # add(0): a restarted attempt's progress stays where training stood until it resumes
        spec.progress.add(0, doing="setting up DeepSpeed", eta_s=None, paused=True)  # until its first step
    with clock.part("engine_setup"):
        engine, scheduler = build_engine(cfg, spec.model, len(spec.vocab_tokens), spec.seed, world,
                                         spec.init_config)
    w = Worker.build(spec, engine, scheduler, rank, world, ray.train.torch.get_device(),
                     RunLogger(spec.tracking, enabled=rank == 0, background=True,  # metrics never wait for MLflow
                               tell=lambda line: spec.progress.add(0, status=line)), local_rank=ctx.get_local_rank())
    w.metrics.restart = clock
    w.watches_drains = True
    return w


def accumulation_of(w: Worker, phase_index: int) -> int:
    return w.spec.pretrain.phases[min(phase_index, len(w.spec.pretrain.phases) - 1)].accumulation(w.world)


def train(w: Worker, position: Position) -> Position:
    """Every phase from `position` on; returns the last position."""
    for phase_index in range(len(w.spec.pretrain.phases)):
        position = run_phase(w, phase_index, position)
    return position


def run_phase(w: Worker, phase_index: int, position: Position) -> Position:
    steps = w.spec.pretrain.phase_steps()
    phase_end = sum(steps[: phase_index + 1])
    if position.step >= phase_end or steps[phase_index] == 0:
        return position
    if phase_index != position.phase:
        position = Position(position.step, phase_index)
    start_phase(w, phase_index)
    while position.step < phase_end:
        position = run_epoch(w, position, phase_end)
        if position.step < phase_end:
            position = Position(position.step, phase_index, position.epoch + 1)
    return position


def start_phase(w: Worker, phase_index: int) -> None:
    """The engine set to the phase's batch sizes, and the metrics to its first logging window."""
    phase = w.spec.pretrain.phases[phase_index]
    w.doing(f"phase {phase_index + 1}: seq {phase.max_seq_length}")
    w.metrics.start_phase(phase_index)
    w.engine.set_train_micro_batch_size(phase.micro_batch_size)
    w.engine.set_train_batch_size(phase.global_batch_size)
    # DeepSpeed finds accumulation boundaries by micro_steps % accumulation steps; a phase (and a resume) always
    # starts on a boundary, so restart the count where the accumulation steps may change.
    w.engine.micro_steps = 0


def run_epoch(w: Worker, position: Position, phase_end: int, batches=None) -> Position:
    """Train from `position` until the epoch's data (`batches`: shard rows in micro-batches of the size the epoch is
    read in, `position.dealt`; default this worker's share of the phase's dataset) or the phase's steps run out."""
    phase_index, epoch = position.phase, position.epoch
    phase = w.spec.pretrain.phases[phase_index]
    masking = masking_spec(w, phase)
    if position.step >= phase_end:
        return position
    sequences, dealt = position.sequences, position.dealt or phase.micro_batch_size
    # An elastic run's micro-batches are seeded by their place in the shared order, not by the rank that trains
    # them: the same global batch trains alike on any worker count (data/shared_order.py).
    shared = w.spec.pretrain.elastic and batches is None
    who = SHARED if shared else w.rank
    for index, raw, pulled_at in w.data.micro_batches(position, batches):
        batch = to_device(mask_batch(raw, masking, batch_rng(w.spec.seed, phase_index, epoch, who, index)), w.device)
        wait = time.perf_counter() - pulled_at  # host time only: nothing here waits for the device
        out = timed_first_step(w, batch, seed_of(w.spec.seed, phase_index, epoch, who, index, 1))
        sequences = (sequences_through(index, phase.micro_batch_size, phase.global_batch_size) if shared
                     else sequences + len(raw["next_sentence_label"]))
        w.metrics.micro_batch(out, batch["attention_mask"], wait)
        if w.engine.global_steps == position.step:
            continue  # inside a gradient accumulation
        position = Position(w.engine.global_steps, phase_index, epoch, index + 1, sequences, dealt, int(shared))
        w.metrics.optimizer_step(position.step, phase_index, w.engine.get_global_grad_norm())
        after_step(w, position, phase_end)
        if position.step >= phase_end:
            break
    return position


def timed_first_step(w: Worker, batch: dict[str, torch.Tensor], dropout_seed: int):
    """train_step; the first one of a compiled model also tells the console that it is compiling, and how long it
    took (minutes for BERT-Large), instead of leaving a silent gap."""
    if not compile_enabled(w.spec.pretrain) or w.compiled:
        return train_step(w, batch, dropout_seed)
    w.metrics.tell(0, status="compiling the model (torch.compile, first step)")
    if w.rank == 0:
        log.info("compiling the model (torch.compile): the first step takes longer")
    with w.metrics.aside("compile") as took:  # a one-off: the ETA's step time is the compiled model's
        out = train_step(w, batch, dropout_seed)
    w.compiled = True
    cached = cache_hits(w.checkpoints.compile_cache)
    w.metrics.restart.compile_note = cached
    w.metrics.tell(0, status=f"model compiled in {took.seconds:.0f} s ({cached})")
    if w.rank == 0:
        log.info("model compiled in %.1f s (first step; %s)", took.seconds, cached)
    return out


def train_step(w: Worker, batch: dict[str, torch.Tensor], dropout_seed: int):
    """One micro-batch (already on the device) forward + backward + (at an accumulation boundary) optimizer step;
    returns the output."""
    torch.manual_seed(dropout_seed)
    out = forward(w, batch)
    w.engine.backward(out.loss)
    w.engine.step()
    return out


def after_step(w: Worker, position: Position, phase_end: int) -> None:
    """What is due at an optimizer step: the logging window, a held-out evaluation, a checkpoint."""
    cfg, step = w.spec.pretrain, position.step
    if step % cfg.log_every_steps == 0 or step == phase_end:
        w.metrics.log_window(step, cfg.phases[position.phase].max_seq_length, w.scheduler.get_last_lr()[0],
                             w.engine.get_global_grad_norm())
    if cfg.eval_every_steps and step % cfg.eval_every_steps == 0 and step < cfg.max_steps:
        evaluate_at(w, position)
    if step % cfg.checkpoint_every_steps == 0 and step < cfg.max_steps:
        checkpoint_at(w, position)
    if w.watches_drains and cfg.drain_check_every_steps and step % cfg.drain_check_every_steps == 0 \
            and step < cfg.max_steps:
        checkpoint_if_drained(w, position)


def checkpoint_if_drained(w: Worker, position: Position) -> None:
    """A node of the run being drained (drain.py): a checkpoint once its deadline is near, then a hold until Ray
    Train restarts the workers without it. Every rank asks Ray Train (a barrier) and acts on rank 0's decision."""
    import ray.train
    import torch.distributed as dist

    info = ray.train.get_preemption_info()
    now = time.time()
    checked_every, w.drain_checked_at = now - (w.drain_checked_at or now), now
    if info is None:
        return
    decided = [drain.notice(info, position.step, now, durable_checkpoint_s(w), checked_every)
               if w.rank == 0 else None]
    dist.broadcast_object_list(decided, src=0)
    if not decided[0].due:
        return
    w.metrics.tell(position.step, status=decided[0].line)
    log.info("rank %d: %s", w.rank, decided[0].line)
    if position.step % w.spec.pretrain.checkpoint_every_steps:  # (none just taken at this step)
        checkpoint_at(w, position, wait_for_upload=True)
    w.doing(f"checkpointed at step {position.step}: waiting for Ray Train to go on without the drained node")
    drain.hold_until_restart(decided[0].hold_until_s)


def durable_checkpoint_s(w: Worker) -> float | None:
    """What the last checkpoint took until it was in storage: its stall and its upload (which an asynchronous
    upload leaves out of the stall); None before one was measured."""
    stall = w.metrics.measured.checkpoint_s
    return None if stall is None else stall + (w.checkpoints.upload_s or 0.0)


def cache_hits(cache) -> str:
    """The first compile's use of inductor's cache: "inductor cache: 6 hits, 0 misses, loaded from the checkpoint"."""
    from torch._dynamo.utils import counters

    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    loaded = ", loaded from the checkpoint" if cache is not None and cache.loaded else ""
    return f"inductor cache: {hits} hit{'s' if hits != 1 else ''}, {misses} miss{'es' if misses != 1 else ''}{loaded}"


def evaluate_at(w: Worker, position: Position) -> None:
    """A held-out evaluation at the phase's length, logged and kept for the curves."""
    phase = w.spec.pretrain.phases[position.phase]
    w.doing(f"evaluating on held-out data (seq {phase.max_seq_length})")
    with w.metrics.aside("evaluation", position.phase) as took:
        held_out = evaluate_heldout(w, phase)
    log.info("rank %d: evaluation at step %d took %.1f s", w.rank, position.step, took.seconds)
    w.metrics.log_evaluation(position.step, held_out)


def checkpoint_at(w: Worker, position: Position, wait_for_upload: bool = False) -> None:
    """A checkpoint of the engine, the position in the data and the curves so far, reported to Ray Train with the
    last window's figures; its upload goes on beside training unless `wait_for_upload` (CheckpointManager.save).
    What training stood still for it is logged (checkpoint/stall_s)."""
    w.doing(f"saving a checkpoint (step {position.step})")
    with w.metrics.aside("checkpoint") as took:
        w.checkpoints.save(position, w.metrics.history, {"step": position.step, **w.metrics.last_window},
                           wait_for_upload)
    w.metrics.checkpoint_stall(position.step, took.seconds)
    log.info("rank %d: checkpoint at step %d stalled training %.2f s%s", w.rank, position.step, took.seconds,
             "" if wait_for_upload or not w.spec.pretrain.async_checkpoint_upload else " (its upload goes on)")


def final_evaluation(w: Worker, position: Position, resumed_from: int) -> dict:
    """The final held-out evaluation with BERT's standard masks at the final phase's length, logged; returns the
    run's final figures with the whole history."""
    cfg = w.spec.pretrain
    final_phase = cfg.phases[cfg.final_phase()]
    w.doing(f"final held-out evaluation (seq {final_phase.max_seq_length})")
    started = time.perf_counter()
    held_out = evaluate_heldout(w, final_phase, training_masks=False)
    log.info("rank %d: final evaluation took %.1f s", w.rank, time.perf_counter() - started)
    # LAMB keeps flat tensors with a per-parameter layout: a test proves LAMB is per layer by this count.
    extra = {"lamb_layouts": mapped_layouts(w.engine)} if cfg.optimizer == "lamb" else {}
    return w.metrics.final(position.step, resumed_from, held_out, **extra)


def export_model(w: Worker) -> None:
    """The model in Hugging Face layout with its tokenizer files (the checkpoint manager's export)."""
    w.doing("exporting the model")
    started = time.perf_counter()
    w.checkpoints.export(w.metrics.run)
    log.info("rank %d: export took %.1f s", w.rank, time.perf_counter() - started)


def save_last_checkpoint(w: Worker, position: Position, final: dict) -> None:
    """The last checkpoint, reported with the final figures (what the driver's result holds). Then Ray Train stops
    the workers: no measurement of this run prices that, so the ETA counts none of it and the line says what runs."""
    w.doing("saving the last checkpoint")
    started = time.perf_counter()
    w.checkpoints.save(position, final["history"][:-1], final, wait_for_upload=True)
    log.info("rank %d: last checkpoint took %.1f s", w.rank, time.perf_counter() - started)
    w.metrics.tell(position.step, doing="stopping the workers")
