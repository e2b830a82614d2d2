"""The per-worker training function of pre-training (runs inside each Ray Train worker), as named steps.

One DeepSpeed engine per worker (engine.py) trains through the phases (seq 128, then 512) on its share of the shards
(streams.py), masking each batch on the fly. The position in the data is (phase, epoch, sequences of the epoch
trained: resume.Position): a checkpoint stores it, and a resumed worker re-reads the epoch and drops the batches it
had already consumed without collating them — with per-batch mask generators and a per-batch dropout seed the
resumed run computes exactly what an uninterrupted run computes. A checkpoint of another layout (worker count,
micro-batch) goes on by the rule of resume.py, its optimizer state re-partitioned if need be (repartition.py). What
each step costs, and the ETA and throughput made from it, is the worker's clock's (clock.py): the loop only marks
where a step ends and what it sets aside.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from bertpipe.jobs.pretrain import runs
from bertpipe.jobs.pretrain.checkpointing import export, folders, resume
from bertpipe.jobs.pretrain.engine.build import build_engine, compile_enabled
from bertpipe.jobs.pretrain.evaluation import evaluate_heldout, evaluation_series, time_eval_batches
from bertpipe.jobs.pretrain.engine.lamb_layout import mapped_layouts
from bertpipe.jobs.pretrain.data.masking import batch_rng, collate
from bertpipe.jobs.pretrain.metrics.meter import THROUGHPUT, NonFiniteError
from bertpipe.jobs.pretrain.data.streams import micro_batches, open_streams
from bertpipe.jobs.pretrain.checkpointing.resume import Position
from bertpipe.jobs.pretrain.worker import Worker, forward, masking_spec, seed_of, to_device
from bertpipe.jobs.pretrain.worker_spec import WorkerSpec
from bertpipe.jobs.services.tracking import RunLogger, metric_names
from bertpipe.pipeline.framework import storage

log = logging.getLogger("bertpipe.pretrain")
# The training figures of a logging window that go into the curves.
CURVE_KEYS = ("loss", "mlm_loss", "mlm_accuracy", "nsp_accuracy")


def train_loop_per_worker(config: dict[str, Any]) -> None:
    spec: WorkerSpec = config["spec"]
    w = setup(spec)
    position = restore(w)
    announce_attempt(w, position)
    open_streams(w, position)
    time_eval_batches(w)  # with the streams open: timed as the machine will be during training
    resumed_from = position.step
    try:
        position, last = train(w, position)
    except NonFiniteError as exc:
        stop_for_good(w, exc)
        return
    final = final_evaluation(w, position, resumed_from, last)
    export_model(w)
    save_last_checkpoint(w, position, final)


def setup(spec: WorkerSpec) -> Worker:
    import ray.train
    import ray.train.torch

    cfg = spec.pretrain
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.cpus_per_worker)
    if rank == 0:  # add(0): a restarted attempt's progress stays where training stood until it resumes
        spec.progress.add(0, doing="setting up DeepSpeed", eta_s=None)
    engine, scheduler = build_engine(cfg, spec.model, len(spec.vocab_tokens), spec.seed, world, spec.init_config)
    return Worker(spec, engine, scheduler, rank, world, ray.train.torch.get_device(),
                  RunLogger(spec.tracking, enabled=rank == 0), local_rank=ctx.get_local_rank())


def restore(w: Worker) -> Position:
    """The later of Ray Train's checkpoint (a retry, or a rerun it has a snapshot for) and the newest complete one in
    the run folder (a rerun after a crash, or a retry that starts before the controller registered the last reported
    checkpoint). Rank 0 decides, so every rank loads the same. A checkpoint of another layout is loaded
    re-partitioned and goes on where resume.plan says (the driver said so in its resume line)."""
    import ray.train

    given = ray.train.get_checkpoint()
    found = [folders.latest_checkpoint(w.spec.storage_path, w.spec.run_name, w.spec.pretrain)
             if w.rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    # The later of the two: a driver killed right after the workers saved leaves a complete checkpoint that Ray
    # Train's snapshot never registered.
    newest = folders.newer(given.path if given is not None else None, found[0])
    checkpoint = given if given is not None and newest == given.path else (
        ray.train.Checkpoint(newest) if newest else None)
    if checkpoint is None:
        return Position()
    now = layout(w)
    return resumed_position(w, folders.load(w.engine, checkpoint, now, w.local_rank), now)


def resumed_position(w: Worker, state: dict, now: dict) -> Position:
    """Where a worker goes on from a loaded checkpoint's position.json (`state`), with this layout (`now`)."""
    w.history = state.pop("history", [])
    then = state.pop("layout", None)
    taken = resume.position_of(state, then or now)
    assert w.engine.global_steps == taken.step, (w.engine.global_steps, taken.step)
    goes_on = resume.plan(taken, then, now, w.spec.pretrain, w.spec.rows)
    log.info("rank %d resumed at %s%s", w.rank, taken,
             f", goes on at {goes_on.position}" if goes_on.position != taken else "")
    return goes_on.position


def layout(w: Worker) -> dict:
    """How the checkpoint's state is laid out: what a resume on another layout must match (runs.check_layout)."""
    cfg = w.spec.pretrain
    return runs.layout_of(w.world, [p.micro_batch_size for p in cfg.phases], cfg.zero_stage)


def announce_attempt(w: Worker, position: Position) -> None:
    """Rank 0 tells the driver's attempt watch (attempts.py) which attempt this is and where it resumed."""
    if w.rank == 0:
        w.spec.progress.set(position.step, attempt_started=time.time(), resumed_from=position.step, eta_s=None)


def train(w: Worker, position: Position) -> tuple[Position, dict]:
    """Every phase from `position` on; returns the last position and the last logged window's figures."""
    last: dict = {}
    for phase_index in range(len(w.spec.pretrain.phases)):
        position, last = run_phase(w, phase_index, position, last)
    return position, last


def run_phase(w: Worker, phase_index: int, position: Position, last: dict) -> tuple[Position, dict]:
    cfg = w.spec.pretrain
    steps = cfg.phase_steps()
    phase_end = sum(steps[: phase_index + 1])
    if position.step >= phase_end or steps[phase_index] == 0:
        return position, last
    if phase_index != position.phase:
        position = Position(position.step, phase_index)
    phase = cfg.phases[phase_index]
    w.doing(f"phase {phase_index + 1}: seq {phase.max_seq_length}")
    w.clock.start_phase(phase_index)
    w.engine.set_train_micro_batch_size(phase.micro_batch_size)
    w.engine.set_train_batch_size(phase.global_batch_size)
    # DeepSpeed finds accumulation boundaries by micro_steps % accumulation steps; a phase (and a resume) always
    # starts on a boundary, so restart the count where the accumulation steps may change.
    w.engine.micro_steps = 0
    while position.step < phase_end:
        position, last = run_epoch(w, position, phase_end, last)
        if position.step < phase_end:
            position = Position(position.step, phase_index, position.epoch + 1)
    return position, last


def run_epoch(w: Worker, position: Position, phase_end: int, last: dict, batches=None) -> tuple[Position, dict]:
    """Train from `position` until the epoch's data (`batches`: shard rows in micro-batches of the size the epoch is
    read in, `position.dealt`; default this worker's share of the phase's dataset) or the phase's steps run out."""
    phase_index, epoch = position.phase, position.epoch
    spec = masking_spec(w, w.spec.pretrain.phases[phase_index])
    if position.step >= phase_end:
        return position, last
    sequences, dealt = position.sequences, position.dealt or w.spec.pretrain.phases[phase_index].micro_batch_size
    for index, raw, pulled_at in micro_batches(w, position, batches):
        batch = to_device(collate(raw, spec, batch_rng(w.spec.seed, phase_index, epoch, w.rank, index)), w.device)
        wait = time.perf_counter() - pulled_at  # host time only: nothing here waits for the device
        out = timed_first_step(w, batch, seed_of(w.spec.seed, phase_index, epoch, w.rank, index, 1))
        sequences += len(raw["next_sentence_label"])
        w.clock.micro_batch(out, batch["attention_mask"], wait)
        if w.engine.global_steps == position.step:
            continue  # inside a gradient accumulation
        position = Position(w.engine.global_steps, phase_index, epoch, index + 1, sequences, dealt)
        w.clock.optimizer_step(position.step, phase_index, w.engine.get_global_grad_norm(), last)
        last = after_step(w, position, phase_end, last)
        if position.step >= phase_end:
            break
    return position, last


def timed_first_step(w: Worker, batch: dict[str, torch.Tensor], dropout_seed: int):
    """train_step; the first one of a compiled model also tells the console that it is compiling, and how long it
    took (minutes for BERT-Large), instead of leaving a silent gap."""
    if not compile_enabled(w.spec.pretrain) or w.compiled:
        return train_step(w, batch, dropout_seed)
    if w.rank == 0:
        w.spec.progress.set(0, status="compiling the model (torch.compile, first step)")
        log.info("compiling the model (torch.compile): the first step takes longer")
    with w.clock.aside("compile") as took:  # a one-off: the ETA's step time is the compiled model's
        out = train_step(w, batch, dropout_seed)
    w.compiled = True
    if w.rank == 0:
        w.spec.progress.set(0, status=f"model compiled in {took.seconds:.0f} s")
        log.info("model compiled in %.0f s (first step)", took.seconds)
    return out


def train_step(w: Worker, batch: dict[str, torch.Tensor], dropout_seed: int):
    """One micro-batch (already on the device) forward + backward + (at an accumulation boundary) optimizer step;
    returns the output."""
    torch.manual_seed(dropout_seed)
    out = forward(w, batch)
    w.engine.backward(out.loss)
    w.engine.step()
    return out


def after_step(w: Worker, position: Position, phase_end: int, last: dict) -> dict:
    """What is due at an optimizer step: the logging window, a held-out evaluation, a checkpoint; returns the
    latest logged figures."""
    cfg, step = w.spec.pretrain, position.step
    if step % cfg.log_every_steps == 0 or step == phase_end:
        last = log_window(w, step, cfg.phases[position.phase].max_seq_length, last)
        w.clock.meter.reset()
    if cfg.eval_every_steps and step % cfg.eval_every_steps == 0 and step < cfg.max_steps:
        evaluate_at(w, position)
    if step % cfg.checkpoint_every_steps == 0 and step < cfg.max_steps:
        checkpoint_at(w, position, last)
    return last


def log_window(w: Worker, step: int, seq_length: int, last: dict | None = None) -> dict[str, float]:
    """The window's figures, all-reduced, logged and kept for the curves; the window's only host reads. The first
    window of a phase (data start-up, compile, resume: Meter.steady) logs no throughput, and the figures returned
    keep the last steady window's throughput (`last`): no speed is reported for it, rather than a wrong one."""
    meter = w.clock.meter
    try:
        figures = meter.summary(w.world)
    except NonFiniteError as exc:
        raise NonFiniteError(f"pretrain (seq {seq_length}): {exc}") from None
    grad_norm = w.engine.get_global_grad_norm()
    metrics = {**figures, "lr": w.scheduler.get_last_lr()[0],
               "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "seq_length": seq_length}
    if not meter.steady:
        metrics = {k: v for k, v in metrics.items() if k not in THROUGHPUT}
    w.run.log_metrics(metric_names(metrics), step)
    w.history.append({"step": step, **{k: metrics[k] for k in CURVE_KEYS}})
    metrics = {**{k: v for k, v in (last or {}).items() if k in THROUGHPUT}, **metrics}
    if w.rank == 0:
        utilisation = ""
        if "model_tflops_per_second" in figures:
            utilisation = f" {figures['model_tflops_per_second']:.1f} TFLOP/s per device"
        if "model_flops_utilization" in figures:
            utilisation += f" (MFU {100 * figures['model_flops_utilization']:.1f}%)"
        log.info("step %d seq %d loss %.4f mlm_acc %.3f nsp_acc %.3f lr %.2e %.1f seq/s wait %.1f%%%s", step,
                 seq_length, metrics["loss"], metrics["mlm_accuracy"], metrics["nsp_accuracy"], metrics["lr"],
                 figures["sequences_per_second"], 100 * figures["data_wait_fraction"], utilisation)
    return metrics


def evaluate_at(w: Worker, position: Position) -> None:
    """A held-out evaluation at the phase's length, logged and kept for the curves."""
    phase = w.spec.pretrain.phases[position.phase]
    w.doing(f"evaluating on held-out data (seq {phase.max_seq_length})")
    with w.clock.aside("evaluation", position.phase) as took:
        held_out = evaluate_heldout(w, phase)
    log.info("rank %d: evaluation at step %d took %.1f s", w.rank, position.step, took.seconds)
    w.run.log_metrics(metric_names(evaluation_series(held_out)), position.step)
    w.history.append({"step": position.step, **held_out})


def checkpoint_at(w: Worker, position: Position, last: dict) -> None:
    """A checkpoint of the engine, the position in the data and the curves so far, reported to Ray Train."""
    w.doing(f"saving a checkpoint (step {position.step})")
    with w.clock.aside("checkpoint") as took:
        folders.save_and_report(w.engine, {**dataclasses.asdict(position), "history": w.history,
                                               "layout": layout(w)},
                                    {"step": position.step, **last})
    log.info("rank %d: checkpoint at step %d took %.1f s", w.rank, position.step, took.seconds)


def stop_for_good(w: Worker, exc: NonFiniteError) -> None:
    """Every rank read the same all-reduced health at the same window, so all stop here together. Left for the
    driver in the run folder, not raised: Ray Train would retry from the last checkpoint and meet the same NaN
    again."""
    if w.rank == 0:
        storage.write_text_atomic(folders.stop_marker(w.spec.storage_path, w.spec.run_name),
                                  json.dumps({"reason": str(exc), "step": w.engine.global_steps}))
    dist.barrier()


def final_evaluation(w: Worker, position: Position, resumed_from: int, last: dict) -> dict:
    """The final held-out evaluation with BERT's standard masks at the final phase's length, logged; returns the
    run's final figures with the whole history."""
    cfg = w.spec.pretrain
    final_phase = cfg.phases[cfg.final_phase()]
    w.doing(f"final held-out evaluation (seq {final_phase.max_seq_length})")
    started = time.perf_counter()
    # resumed_from_step: where this attempt started — a test reads it to prove no progress was lost.
    final = {"step": position.step, "resumed_from_step": resumed_from, **last,
             **evaluate_heldout(w, final_phase, training_masks=False)}
    log.info("rank %d: final evaluation took %.1f s", w.rank, time.perf_counter() - started)
    if cfg.optimizer == "lamb":  # flat tensors with a per-parameter layout: a test proves LAMB is per layer
        final["lamb_layouts"] = mapped_layouts(w.engine)
    held_out = {k: v for k, v in final.items() if k.startswith("eval_")}
    w.run.log_metrics(metric_names(evaluation_series(held_out)), position.step)
    final["history"] = [*w.history, {"step": position.step, **held_out}]
    return final


def export_model(w: Worker) -> None:
    """The model in Hugging Face layout with its tokenizer files (export.export)."""
    spec = w.spec
    w.doing("exporting the model")
    started = time.perf_counter()
    export.export(w.engine, spec.vocab_bytes, spec.export_uri, spec.pretrain.zero_stage, w.rank, w.run,
                       export.data_lowercase(spec.heldout))
    log.info("rank %d: export took %.1f s", w.rank, time.perf_counter() - started)


def save_last_checkpoint(w: Worker, position: Position, final: dict) -> None:
    """The last checkpoint, reported with the final figures (what the driver's result holds). Then Ray Train stops
    the workers: no measurement of this run prices that, so the ETA counts none of it and the line says what runs."""
    w.doing("saving the last checkpoint")
    started = time.perf_counter()
    folders.save_and_report(w.engine, {**dataclasses.asdict(position), "history": final["history"][:-1],
                                           "layout": layout(w)}, final)
    log.info("rank %d: last checkpoint took %.1f s", w.rank, time.perf_counter() - started)
    if w.rank == 0:
        w.spec.progress.set(position.step, doing="stopping the workers")
