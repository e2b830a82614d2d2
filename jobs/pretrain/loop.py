"""The per-worker training function of pre-training (runs inside each Ray Train worker).

One DeepSpeed engine per worker trains through the phases (seq 128, then 512) on its share of the shards
(`ray.train.get_dataset_shard`, streamed, order preserved so the split is deterministic), masking each batch
on the fly. The position in the data is (phase, epoch, sequences of the epoch trained: resume.Position): a
checkpoint stores it, and a resumed worker re-reads the epoch and drops the batches it had already consumed
without collating them — with per-batch mask generators and a per-batch dropout seed the resumed run computes
exactly what an uninterrupted run computes. A checkpoint of another layout (worker count, micro-batch) goes on
by the rule of resume.py, its optimizer state re-partitioned if need be (repartition.py).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bertpipe.jobs.pretrain import checkpoints, eta, identity, resume
from bertpipe.jobs.pretrain.config import ModelConfig, PhaseConfig, PretrainConfig, bert_config
from bertpipe.jobs.pretrain.deepspeed_config import deepspeed_config
from bertpipe.jobs.pretrain.heldout import read_heldout
from bertpipe.jobs.pretrain.lamb_layout import attach_lamb_layouts, mapped_layouts
from bertpipe.jobs.pretrain.length_binning import length_binned
from bertpipe.jobs.pretrain.masking import MaskingSpec, batch_rng, collate
from bertpipe.jobs.pretrain.meter import THROUGHPUT, Meter, NonFiniteError, all_sum
from bertpipe.jobs.pretrain.optim import make_optimizer, make_scheduler
from bertpipe.jobs.pretrain.resume import Position
from bertpipe.jobs.pretrain import zero_fast_paths
from bertpipe.jobs.tracking import RunLogger, metric_names
from bertpipe.pipeline import storage
from bertpipe.model.training import param_groups
from bertpipe.pipeline.progress import Reporter

log = logging.getLogger("bertpipe.pretrain")
# The training figures of a logging window that go into the curves.
CURVE_KEYS = ("loss", "mlm_loss", "mlm_accuracy", "nsp_accuracy")
EVAL_PHASE = 99  # the masking seed's "phase" part for held-out evaluation: fixed masks, never a training phase
EVAL_BATCH = eta.EVAL_BATCH  # sequences per held-out batch


@dataclass(frozen=True)
class WorkerSpec:
    """Everything the driver hands every worker; every path in it is absolute or a URI."""

    pretrain: PretrainConfig
    model: ModelConfig
    seed: int
    vocab_tokens: list[str]
    vocab_bytes: bytes
    tracking: dict[str, str]
    export_uri: str
    storage_path: str
    run_name: str
    progress: Reporter = field(default_factory=Reporter)  # the driver's live progress line (rank 0 reports)
    rows: dict[str, int] = field(default_factory=dict)  # {"train_128": rows, "heldout_128": rows, ...}
    heldout: dict[int, str] = field(default_factory=dict)  # seq length -> held-out shard (read by heldout.py)
    init: str = ""  # pretrain.init: the BERT folder every worker loads its weights from (init.py), "" = random
    init_config: dict = field(default_factory=dict)  # its config.json: the model's shape


@dataclass
class Worker:
    spec: WorkerSpec
    engine: Any
    scheduler: Any
    rank: int
    world: int
    device: Any
    run: RunLogger
    compiled: bool = False  # the first step of a compiled model has run (it compiled)
    eval_compiled: bool = False  # the same for evaluation (eval mode and its batch shape compile apart)
    # Logged windows and held-out evaluations, {"step": .., figure: ..}: the curves the driver draws. Saved in every
    # checkpoint, so a resumed run's curves start at step 1 too.
    history: list[dict[str, float]] = field(default_factory=list)
    # The ETA (eta.py): what rank 0 measured, and the time of the last optimizer step with the seconds since then
    # spent on things the clock prices apart (data stream starts, evaluations, checkpoints).
    clock: eta.Clock = field(default_factory=eta.Clock)
    heldout: dict[int, list] = field(default_factory=dict)  # seq length -> this worker's held-out batches
    opened: dict[tuple[int, int], tuple] = field(default_factory=dict)  # (phase, epoch) -> (first batch, the rest)
    mark: float = 0.0
    excluded: float = 0.0
    local_rank: int = 0  # its rank on its node: one rank a node converts a checkpoint of another layout

    def schedule(self) -> eta.Schedule:
        cfg, rows = self.spec.pretrain, self.spec.rows
        per_worker = {k: v // self.world for k, v in rows.items()}
        return eta.Schedule(cfg, self.spec.model, len(self.spec.vocab_tokens), self.world,
                            {q: per_worker.get(f"train_{p.max_seq_length}", 0) for q, p in enumerate(cfg.phases)},
                            {q: per_worker.get(f"heldout_{p.max_seq_length}", 0) for q, p in enumerate(cfg.phases)},
                            self.spec.init_config)

    def doing(self, what: str) -> None:
        """Rank 0 tells the driver's progress line what the workers are busy with (shown if it takes a while)."""
        if self.rank == 0:
            self.spec.progress.set(self.engine.global_steps if self.engine is not None else 0, doing=what)

    def report_step(self, position: "Position", last: dict) -> None:
        """Rank 0, at an optimizer step: the step, the last window's figures and the seconds left (eta.py)."""
        if self.rank != 0:
            return
        left = eta.seconds_left(self.schedule(), self.clock, position.step, position.phase)
        # The last window's figures: reading this step's loss would wait for the device.
        self.spec.progress.set(position.step, loss=last.get("loss"), seq_s=last.get("sequences_per_second", 0.0),
                               doing="", eta_s=left, eta_at=time.time())


def flops_counter(model_cfg: ModelConfig, vocab_size: int, masked: int, init_config: dict | None = None):
    """Useful FLOPs of a micro-batch of shape (batch, seq) of this model (model/flops.py), for the meter."""
    from bertpipe.model.flops import step_flops

    bert_cfg = bert_config(model_cfg, vocab_size, init_config)
    return lambda batch, seq: step_flops(bert_cfg, batch, seq, masked)


def device_peak_tflops(device) -> float | None:
    """The GPU's dense bf16 peak from its name (None on a CPU or an unknown card: no utilisation is logged)."""
    if getattr(device, "type", str(device)) != "cuda":
        return None
    from bertpipe.model.flops import peak_tflops

    return peak_tflops(torch.cuda.get_device_name(device))


def seed_of(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def build_model(model_cfg: ModelConfig, vocab_size: int, seed: int, init: str = "", init_config: dict | None = None):
    """The model a worker trains: randomly initialised, or (`init`, pretrain.init) with the checkpoint's weights,
    loaded here, before DeepSpeed wraps it; what the checkpoint lacks keeps the seeded initialisation."""
    from bertpipe.model import BertForPreTraining

    bert_cfg = bert_config(model_cfg, vocab_size, init_config,
                           activation_checkpointing=model_cfg.activation_checkpointing,
                           hidden_dropout_prob=model_cfg.hidden_dropout_prob,
                           attention_probs_dropout_prob=model_cfg.attention_probs_dropout_prob)
    torch.manual_seed(seed)  # identical initial weights on every rank (ZeRO-3 partitions each rank's copy)
    model = BertForPreTraining(bert_cfg)
    if init:
        from bertpipe.jobs.pretrain.init import heads_line, heads_named, load_into

        started = time.perf_counter()
        fresh = load_into(model, init)
        log.info("%s (loaded in %.1f s)", heads_line(init, heads_named(model, fresh)), time.perf_counter() - started)
    return model


def build_engine(cfg: PretrainConfig, model_cfg: ModelConfig, vocab_size: int, seed: int, world: int,
                 init_config: dict | None = None):
    """The DeepSpeed engine and LR scheduler of one worker (torch.distributed already initialised): what every
    worker runs, and what the CPU tests and the step profile build without Ray. With pretrain.init set, the model
    starts from that checkpoint's weights (`init_config`: its config.json)."""
    import deepspeed

    skip_inference_comm_op()
    model = build_model(model_cfg, vocab_size, seed, cfg.init, init_config)
    if cfg.optimizer_impl == "torch":
        optimizer, params = make_optimizer(cfg, model), None
    else:
        optimizer, params = None, param_groups(model, cfg.weight_decay)
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=params, config=deepspeed_config(cfg, cfg.phases[0], world),
        dist_init_required=False, lr_scheduler=lambda opt: make_scheduler(cfg, opt))
    if cfg.optimizer == "lamb":
        attach_lamb_layouts(engine)  # DeepSpeed now holds flat partitions: one trust ratio per parameter still
    zero_fast_paths.install(engine)
    if compile_enabled(cfg):
        engine.compile()  # lazy: the first forward of each new shape compiles (train_step says so)
    return engine, scheduler


def compile_enabled(cfg: PretrainConfig) -> bool:
    return cfg.use_gpu if cfg.compile is None else cfg.compile


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


def skip_inference_comm_op() -> None:
    """Tell DeepSpeed not to build its shared-memory communication op (`deepspeed_shm_comm`). Its communication
    backend JIT-compiles the op at start-up on a CPU machine, though only `inference_all_reduce` (tensor-parallel
    inference) calls it; training reduces through torch.distributed. The build took 50-90 s on 2 cores, once per
    machine and again whenever the environment's path changed (a new venv, a fresh clone), since the build file
    records the include paths. `deepspeed.ops.__compatible_ops__` is the one dict DeepSpeed reads to decide."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def restore(w: Worker) -> Position:
    """The later of Ray Train's checkpoint (a retry, or a rerun it has a snapshot for) and the newest complete one in
    the run folder (a rerun after a crash, or a retry that starts before the controller registered the last reported
    checkpoint). Rank 0 decides, so every rank loads the same. A checkpoint of another layout is loaded
    re-partitioned and goes on where resume.plan says (the driver said so in its resume line)."""
    import ray.train

    given = ray.train.get_checkpoint()
    found = [checkpoints.latest_checkpoint(w.spec.storage_path, w.spec.run_name, w.spec.pretrain)
             if w.rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    # The later of the two: a driver killed right after the workers saved leaves a complete checkpoint that Ray
    # Train's snapshot never registered.
    newest = checkpoints.newer(given.path if given is not None else None, found[0])
    checkpoint = given if given is not None and newest == given.path else (
        ray.train.Checkpoint(newest) if newest else None)
    if checkpoint is None:
        return Position()
    now = layout(w)
    return resumed_position(w, checkpoints.load(w.engine, checkpoint, now, w.local_rank), now)


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
    """How the checkpoint's state is laid out: what a resume on another layout must match (identity.check_layout)."""
    cfg = w.spec.pretrain
    return identity.layout_of(w.world, [p.micro_batch_size for p in cfg.phases], cfg.zero_stage)


def masking_spec(w: Worker, phase: PhaseConfig, training: bool = True) -> MaskingSpec:
    """The phase's masking as configured, or (training=False) BERT's standard token-level 15% for the final
    evaluation, so runs with other masking settings are compared on the same task."""
    cfg = w.spec.pretrain
    if not training:
        return MaskingSpec.from_vocab(w.spec.vocab_tokens, max_seq_length=phase.max_seq_length,
                                      max_predictions=phase.max_predictions_per_seq)
    return MaskingSpec.from_vocab(w.spec.vocab_tokens, max_seq_length=phase.max_seq_length,
                                  max_predictions=phase.max_predictions_per_seq, masked_lm_prob=cfg.masked_lm_prob,
                                  whole_word=cfg.whole_word_masking)


def to_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """Host batch → device. On a GPU through pinned memory, so the copy is asynchronous and queues behind the
    running step instead of making the host wait for it."""
    if getattr(device, "type", str(device)) == "cuda":
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


def forward(w: Worker, b: dict[str, torch.Tensor]):
    """The model on a batch already on the device (see to_device)."""
    return w.engine(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["masked_positions"],
                    b["masked_lm_labels"], b["next_sentence_label"])


def heldout_batches(w: Worker, phase: PhaseConfig) -> list[dict[str, np.ndarray]]:
    """This worker's held-out rows at the phase's length (at most eval_max_batches batches of EVAL_BATCH, heldout.py),
    read once: every evaluation reuses them."""
    length = phase.max_seq_length
    if length not in w.heldout:
        started = time.perf_counter()
        w.heldout[length] = read_heldout(w.spec.heldout[length], w.rank, w.world, w.spec.rows[f"heldout_{length}"],
                                         w.spec.pretrain.eval_max_batches, EVAL_BATCH)
        log.info("rank %d: %d held-out batches at seq %d read in %.1f s", w.rank, len(w.heldout[length]), length,
                 time.perf_counter() - started)
    return w.heldout[length]


def open_streams(w: Worker, position: Position) -> None:
    """Before the first step, every data stream the run opens at a known time, opened at once (in threads: Ray
    Data starts an execution for each, seconds each on a small machine, mostly waiting on processes): the first
    training epoch of every phase still to train, its first micro-batches pulled (run_epoch goes on from there),
    and meanwhile each phase's held-out rows are read (heldout_batches). No phase switch and no evaluation waits
    for data mid-training, and what is left after any step is predictable (eta.py)."""
    from concurrent.futures import ThreadPoolExecutor

    cfg = w.spec.pretrain
    ends = np.cumsum(cfg.phase_steps())
    streams, heldout = {}, []
    for q, (phase, steps) in enumerate(zip(cfg.phases, cfg.phase_steps())):
        if not steps:
            continue
        heldout.append(phase)
        if ends[q] > position.step and q >= position.phase:
            epoch, dealt = (position.epoch, position.dealt) if q == position.phase else (0, 0)
            streams[f"seq {phase.max_seq_length}"] = (_open_epoch, w, q, epoch, dealt or phase.micro_batch_size)
    w.doing(f"opening the training data streams ({', '.join(streams)})" if streams else "reading held-out data")
    with ThreadPoolExecutor(max_workers=max(len(streams), 1), thread_name_prefix="open-stream") as pool:
        futures = [pool.submit(*job) for job in streams.values()]
        for phase in heldout:
            heldout_batches(w, phase)
        for future in futures:
            future.result()
    time_eval_batches(w)  # with the streams open: timed as the machine will be during training


# Forwards timed per phase, the fastest kept: a new sequence length's first forward allocates (and the data streams
# just opened still prefetch), and one timing alone priced the tiny preset's final evaluation 2-3 times too high.
TIMED_FORWARDS = 2


def time_eval_batches(w: Worker) -> None:
    """On a CPU, one held-out batch of each phase through the model, timed: what an evaluation costs before the first
    one ran (eta.py). Pricing it from the training step instead (a forward is a third of a step's work per sequence)
    holds where compute dominates a step; on a CPU's small models the optimizer and the all-reduce do, and the
    evaluations came out 2-3 times dearer than they were (the tiny preset's ETA 3 s high at step 10 of 40). Not on a
    GPU: the rule holds there, and a compiled model's first evaluation compiles (its timing would be the compiler's)."""
    if w.device.type != "cpu" or compile_enabled(w.spec.pretrain):
        return
    cfg = w.spec.pretrain
    w.engine.eval()
    with torch.no_grad():
        for q, (phase, steps) in enumerate(zip(cfg.phases, cfg.phase_steps())):
            batches = heldout_batches(w, phase) if steps else []
            if batches:
                rng = batch_rng(w.spec.seed, EVAL_PHASE, 0, w.rank, 0)
                batch = to_device(collate(batches[0], masking_spec(w, phase, False), rng), w.device)
                w.clock.eval_batch_s[q] = min(_timed_forward(w, batch) for _ in range(TIMED_FORWARDS))
    w.engine.train()


def _timed_forward(w: Worker, batch: dict[str, torch.Tensor]) -> float:
    started = time.perf_counter()
    forward(w, batch)
    return time.perf_counter() - started


def _open_epoch(w: Worker, phase_index: int, epoch: int, micro: int) -> None:
    started = time.perf_counter()
    it = iter(epoch_batches(w, phase_index, epoch, micro))
    w.opened[(phase_index, epoch)] = (next(it, None), it)
    opened = time.perf_counter() - started
    w.clock.stream_start_s = max(w.clock.stream_start_s or 0.0, opened)
    log.info("rank %d: training stream phase %d epoch %d opened in %.1f s", w.rank, phase_index, epoch, opened)


def evaluate(w: Worker, phase: PhaseConfig, training_masks: bool = True) -> dict[str, float]:
    """Held-out MLM/NSP accuracy with a fixed masking seed, summed over all workers (every rank runs the same
    number of forwards: ZeRO-3 gathers parameters collectively)."""
    batches = heldout_batches(w, phase)
    spec = masking_spec(w, phase, training_masks)
    if compile_enabled(w.spec.pretrain) and not w.eval_compiled and w.rank == 0:
        w.spec.progress.set(w.engine.global_steps, status="compiling the model for evaluation (first evaluation)")
    w.eval_compiled = True
    names = ("mlm_correct", "mlm_count", "nsp_correct", "mlm_loss")
    totals = torch.zeros(len(names), dtype=torch.float64, device=w.device)  # summed on the device, read once below
    sequences = 0  # known on the host: no device tensor needed
    w.engine.eval()
    with torch.no_grad():
        for i, raw in enumerate(batches):
            out = forward(w, to_device(collate(raw, spec, batch_rng(w.spec.seed, EVAL_PHASE, 0, w.rank, i)),
                                       w.device))
            totals += torch.stack([out.mlm_correct.float(), out.mlm_count.float(), out.nsp_correct.float(),
                                   out.mlm_loss.detach().float() * out.mlm_count.float()]).double()
            sequences += len(raw["next_sentence_label"])
    w.engine.train()
    s = dict(zip(names + ("sequences",), all_sum([*totals.tolist(), float(sequences)], w.device)))
    return {"eval_mlm_accuracy": s["mlm_correct"] / max(s["mlm_count"], 1),
            "eval_nsp_accuracy": s["nsp_correct"] / max(s["sequences"], 1),
            "eval_mlm_loss": s["mlm_loss"] / max(s["mlm_count"], 1), "eval_sequences": s["sequences"]}


def evaluation_series(held_out: dict[str, float]) -> dict[str, float]:
    """What of an evaluation is an MLflow series: its accuracies and loss (the count of held-out sequences, the
    same every time, goes into the stage's summary)."""
    return {k: v for k, v in held_out.items() if k != "eval_sequences"}


def train_step(w: Worker, batch: dict[str, torch.Tensor], dropout_seed: int):
    """One micro-batch (already on the device) forward + backward + (at an accumulation boundary) optimizer step;
    returns the output."""
    torch.manual_seed(dropout_seed)
    out = forward(w, batch)
    w.engine.backward(out.loss)
    w.engine.step()
    return out


def log_window(w: Worker, meter: Meter, step: int, seq_length: int, last: dict | None = None) -> dict[str, float]:
    """The window's figures, all-reduced, logged and kept for the curves; the window's only host reads. The first
    window of a phase (data start-up, compile, resume: Meter.steady) logs no throughput, and the figures returned
    keep the last steady window's throughput (`last`): no speed is reported for it, rather than a wrong one."""
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


def epoch_batches(w: Worker, phase_index: int, epoch: int, micro: int | None = None):
    """This worker's micro-batches of one epoch of a phase, shuffled and length-binned with seeds of (epoch, rank):
    of the phase's micro_batch_size, or of `micro` rows (an epoch dealt in another size before a resume)."""
    import ray.train

    cfg, phase = w.spec.pretrain, w.spec.pretrain.phases[phase_index]
    batches = ray.train.get_dataset_shard(f"train_{phase.max_seq_length}").iter_batches(
        batch_size=micro or phase.micro_batch_size, batch_format="numpy", drop_last=True,
        prefetch_batches=cfg.prefetch_batches, local_shuffle_buffer_size=cfg.shuffle_buffer_rows or None,
        local_shuffle_seed=seed_of(w.spec.seed, phase_index, epoch, w.rank))
    return length_binned(batches, cfg.length_bin_window,
                         np.random.default_rng(seed_of(w.spec.seed, phase_index, epoch, w.rank, 2)))


def after_step(w: Worker, meter: Meter, position: Position, phase_end: int, last: dict) -> dict:
    """Logging, evaluation and checkpointing at an optimizer step; returns the latest logged metrics."""
    cfg, step = w.spec.pretrain, position.step
    phase = cfg.phases[position.phase]
    if step % cfg.log_every_steps == 0 or step == phase_end:
        last = log_window(w, meter, step, phase.max_seq_length, last)
        meter.reset()
    if cfg.eval_every_steps and step % cfg.eval_every_steps == 0 and step < cfg.max_steps:
        w.doing(f"evaluating on held-out data (seq {phase.max_seq_length})")
        started = time.perf_counter()
        held_out = evaluate(w, phase)
        w.clock.eval_s[position.phase] = took = time.perf_counter() - started
        w.excluded += took
        meter.pause(took)  # keep evaluation time out of throughput
        log.info("rank %d: evaluation at step %d took %.1f s", w.rank, step, took)
        w.run.log_metrics(metric_names(evaluation_series(held_out)), step)
        w.history.append({"step": step, **held_out})
    if step % cfg.checkpoint_every_steps == 0 and step < cfg.max_steps:
        w.doing(f"saving a checkpoint (step {step})")
        started = time.perf_counter()
        checkpoints.save_and_report(w.engine, {**dataclasses.asdict(position), "history": w.history,
                                               "layout": layout(w)},
                                    {"step": step, **last})
        w.clock.checkpoint_s = took = time.perf_counter() - started
        w.excluded += took
        log.info("rank %d: checkpoint at step %d took %.1f s", w.rank, step, took)
        meter.pause(took)  # keep checkpoint time out of throughput
    return last


def run_epoch(w: Worker, meter: Meter, position: Position, phase_end: int, last: dict,
              batches=None) -> tuple[Position, dict]:
    """Train from `position` until the epoch's data (`batches`: shard rows in micro-batches of the size the epoch is
    read in, `position.dealt`; default this worker's share of the phase's dataset) or the phase's steps run out.
    An epoch read in another size than the phase's now (a resume with another micro-batch) goes on re-cut
    (resume.recut): the sequences not trained yet, in their order."""
    phase_index, epoch = position.phase, position.epoch
    micro = w.spec.pretrain.phases[phase_index].micro_batch_size
    dealt = position.dealt or micro
    spec = masking_spec(w, w.spec.pretrain.phases[phase_index])
    seen, sequences = 0, position.sequences
    ahead = w.opened.pop((phase_index, epoch), None) if batches is None else None  # open_streams opened it
    if ahead is not None:
        it = itertools.chain([ahead[0]] if ahead[0] is not None else [], ahead[1])
    else:
        it = iter(batches) if batches is not None else epoch_batches(w, phase_index, epoch, dealt)
    if dealt == micro and sequences % micro == 0:  # the batches as dealt: those trained skipped, uncollated
        skip, index = sequences // micro, 0
    else:
        skip, index, it = 0, position.batch, _recut(it, sequences, micro)
    while position.step < phase_end:
        t_wait = time.perf_counter()
        raw = next(it, None)
        if seen == 0 and ahead is None:  # the first batch of a new data stream: Ray Data starts an execution
            w.clock.stream_start_s = opened = time.perf_counter() - t_wait
            w.excluded += opened
            log.info("rank %d: seq %d data stream opened in %.1f s", w.rank,
                     w.spec.pretrain.phases[phase_index].max_seq_length, opened)
        if raw is None:
            break
        seen += 1
        if index < skip:  # consumed before the checkpoint we resumed from
            index += 1
            continue
        batch = to_device(collate(raw, spec, batch_rng(w.spec.seed, phase_index, epoch, w.rank, index)), w.device)
        wait = time.perf_counter() - t_wait  # host time only: nothing here waits for the device
        out = timed_first_step(w, batch, seed_of(w.spec.seed, phase_index, epoch, w.rank, index, 1))
        index += 1
        sequences += len(raw["next_sentence_label"])
        meter.add(out, batch["attention_mask"], wait)
        if w.engine.global_steps == position.step:
            continue  # inside a gradient accumulation
        position = Position(w.engine.global_steps, phase_index, epoch, index, sequences, dealt)
        meter.end_step(position.step, w.engine.get_global_grad_norm())
        now = time.perf_counter()
        if w.mark:
            w.clock.step(phase_index, max(now - w.mark - w.excluded, 0.0))
        w.mark, w.excluded = now, 0.0
        w.report_step(position, last)
        last = after_step(w, meter, position, phase_end, last)
    if seen == 0 and not position.sequences:  # (a re-cut epoch resumed at its end has no batch left)
        raise ValueError(f"worker {w.rank} got no batch at seq {w.spec.pretrain.phases[phase_index].max_seq_length}:"
                         " too few training rows for num_workers × micro_batch_size")
    return position, last


def _recut(it, sequences: int, micro: int):
    """resume.recut, said once in the log (a resume with another micro-batch)."""
    log.info("the epoch in progress goes on re-cut: %d sequences trained, micro-batches of %d from here", sequences,
             micro)
    return resume.recut(it, sequences, micro)


def timed_first_step(w: Worker, batch: dict[str, torch.Tensor], dropout_seed: int):
    """train_step; the first one of a compiled model also tells the console that it is compiling, and how long it
    took (minutes for BERT-Large), instead of leaving a silent gap."""
    if not compile_enabled(w.spec.pretrain) or w.compiled:
        return train_step(w, batch, dropout_seed)
    if w.rank == 0:
        w.spec.progress.set(0, status="compiling the model (torch.compile, first step)")
        log.info("compiling the model (torch.compile): the first step takes longer")
    started = time.perf_counter()
    out = train_step(w, batch, dropout_seed)
    w.compiled = True
    took = time.perf_counter() - started
    w.excluded += took  # a one-off: the ETA's step time is the compiled model's
    if w.rank == 0:
        w.spec.progress.set(0, status=f"model compiled in {took:.0f} s")
        log.info("model compiled in %.0f s (first step)", took)
    return out


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
    w.mark = w.mark or time.perf_counter()
    w.engine.set_train_micro_batch_size(phase.micro_batch_size)
    w.engine.set_train_batch_size(phase.global_batch_size)
    # DeepSpeed finds accumulation boundaries by micro_steps % accumulation steps; a phase (and a resume) always
    # starts on a boundary, so restart the count where the accumulation steps may change.
    w.engine.micro_steps = 0
    meter = Meter(w.device, flops_counter(w.spec.model, len(w.spec.vocab_tokens), phase.max_predictions_per_seq,
                                          w.spec.init_config), device_peak_tflops(w.device))
    while position.step < phase_end:
        position, last = run_epoch(w, meter, position, phase_end, last)
        if position.step < phase_end:
            position = Position(position.step, phase_index, position.epoch + 1)
    return position, last


def train_loop_per_worker(config: dict[str, Any]) -> None:
    spec: WorkerSpec = config["spec"]
    w = setup(spec)
    position = restore(w)
    if w.rank == 0:  # the driver's attempt watch (attempts.py): which attempt this is and where it resumed
        spec.progress.set(position.step, attempt_started=time.time(), resumed_from=position.step, eta_s=None)
    open_streams(w, position)
    resumed_from, last = position.step, {}
    try:
        for phase_index in range(len(spec.pretrain.phases)):
            position, last = run_phase(w, phase_index, position, last)
    except NonFiniteError as exc:
        # Every rank read the same all-reduced health at the same window, so all stop here together. Left for the
        # driver in the run folder, not raised: Ray Train would retry from the last checkpoint and meet the same
        # NaN again.
        if w.rank == 0:
            storage.write_text_atomic(checkpoints.stop_marker(spec.storage_path, spec.run_name),
                                      json.dumps({"reason": str(exc), "step": w.engine.global_steps}))
        dist.barrier()
        return
    final_phase = spec.pretrain.phases[spec.pretrain.final_phase()]
    # resumed_from_step: where this attempt started — a test reads it to prove no progress was lost.
    w.doing(f"final held-out evaluation (seq {final_phase.max_seq_length})")
    started = time.perf_counter()
    final = {"step": position.step, "resumed_from_step": resumed_from, **last,
             **evaluate(w, final_phase, training_masks=False)}
    log.info("rank %d: final evaluation took %.1f s", w.rank, time.perf_counter() - started)
    if spec.pretrain.optimizer == "lamb":  # flat tensors with a per-parameter layout: a test proves LAMB is per layer
        final["lamb_layouts"] = mapped_layouts(w.engine)
    held_out = {k: v for k, v in final.items() if k.startswith("eval_")}
    w.run.log_metrics(metric_names(evaluation_series(held_out)), position.step)
    final["history"] = [*w.history, {"step": position.step, **held_out}]
    w.doing("exporting the model")
    started = time.perf_counter()
    checkpoints.export(w.engine, spec.vocab_bytes, spec.export_uri, spec.pretrain.zero_stage, w.rank, w.run,
                       checkpoints.data_lowercase(spec.heldout))
    log.info("rank %d: export took %.1f s", w.rank, time.perf_counter() - started)
    w.doing("saving the last checkpoint")
    started = time.perf_counter()
    checkpoints.save_and_report(w.engine, {**dataclasses.asdict(position), "history": final["history"][:-1],
                                           "layout": layout(w)}, final)
    log.info("rank %d: last checkpoint took %.1f s", w.rank, time.perf_counter() - started)
