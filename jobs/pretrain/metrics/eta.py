"""How long a pre-training has left, estimated on rank 0 from what it has measured so far (the progress line's ETA).

Optimizer steps are only part of it: on the tiny preset they take a fraction of the stage. The estimate adds
everything still scheduled:

- the steps left in every phase; a phase that has not started is priced from the measured one by its compute per
  step (`step_cost`: the model's training FLOPs for the phase's batch and sequence length), so the switch from
  seq 128 to seq 512 is counted before it happens;
- each data stream still to open: a new epoch (Ray Data starts an execution for each, seconds on a small machine;
  every phase's first one is opened, and the held-out rows read, before the first step, streams.WorkerData.open_all),
  priced by the longest stream start measured;
- each held-out evaluation still scheduled, and the final one: measured once one ran; before that, on a CPU, from
  one held-out batch timed before the first step (evaluation.time_eval_batches), else its forward passes at the
  measured training speed (a forward pass is about a third of a training step);
- each checkpoint still scheduled, and the export: measured once a checkpoint ran; before that their bytes at an
  assumed storage speed.

Everything is priced from this run's own measurements (the storage speed is assumed only until the first checkpoint
was measured), nothing from a machine the code was tuned on. What follows the workers' last checkpoint (Ray Train
stopping them, the driver's curves and registration) is measured by nothing before it runs: the ETA does not count
it, and the progress line and the console say what runs then.

`Measurements` holds what was measured (plain floats from `time.perf_counter()`, no device read: the step path stays
free of host syncs; training_metrics.TrainingMetrics takes them where the loop marks); `Schedule` knows what is left
from a step; `seconds_left` combines them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from bertpipe.jobs.pretrain.config import ModelConfig, PhaseConfig, PretrainConfig, bert_config

EVAL_BATCH = 32  # evaluation.evaluate_heldout's batch size
ASSUMED_BYTES_S = 200e6  # storage speed assumed for a checkpoint before one was measured
STEADY_STEPS = 3  # steps of a phase before its own step time prices its remaining steps


def step_cost(model: ModelConfig, vocab_size: int, phase: PhaseConfig, init_config: dict | None = None) -> float:
    """Training FLOPs of one optimizer step of `phase` (all workers), up to a constant: dense layers (6 × params ×
    tokens), attention (quadratic in the length) and the MLM head over the predicted positions."""
    bert = bert_config(model, vocab_size, init_config)
    h, layers, length = bert.hidden_size, bert.num_hidden_layers, phase.max_seq_length
    dense = layers * (4 * h * h + 2 * h * bert.intermediate_size)
    per_sequence = 6 * dense * length + 12 * layers * length * length * h \
        + 6 * h * vocab_size * phase.max_predictions_per_seq
    return float(per_sequence * phase.global_batch_size)


def state_bytes(model: ModelConfig, vocab_size: int, init_config: dict | None = None) -> tuple[float, float]:
    """(checkpoint bytes, export bytes) of all ranks: fp32 weights + Adam's two moments, and the weights alone."""
    bert = bert_config(model, vocab_size, init_config)
    h = bert.hidden_size
    params = (vocab_size + bert.max_position_embeddings + 2) * h \
        + bert.num_hidden_layers * (4 * h * h + 2 * h * bert.intermediate_size)
    return 12.0 * params, 4.0 * params


@dataclass
class Measurements:
    """What rank 0 measured: seconds per optimizer step of each phase (stream starts, evaluations and checkpoints
    excluded), the last stream start, the last evaluation of each phase (and one timed batch of each), the last
    checkpoint."""

    step_s: dict[int, list[float]] = field(default_factory=dict)
    stream_start_s: float | None = None
    eval_s: dict[int, float] = field(default_factory=dict)
    eval_batch_s: dict[int, float] = field(default_factory=dict)  # one held-out batch's forward, per phase
    checkpoint_s: float | None = None

    def step(self, phase: int, seconds: float) -> None:
        self.step_s.setdefault(phase, []).append(seconds)

    def mean_step(self, phase: int) -> float | None:
        """A typical step of the phase: the median of the recent ones. The first steps of a phase (allocator and
        cache warm-up) are several times slower on a small run; a mean carried them into every early ETA."""
        times = sorted(self.step_s.get(phase, [])[-50:])
        if not times:
            return None
        mid = len(times) // 2
        return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2

    def steady_step(self, phase: int) -> float | None:
        """The phase's typical step once it has STEADY_STEPS of them: its first step alone (at a new sequence
        length) is slow, and would price the whole phase."""
        return self.mean_step(phase) if len(self.step_s.get(phase, [])) >= STEADY_STEPS else None


@dataclass(frozen=True)
class Schedule:
    """What a pre-training does from any step on: steps per phase, when it evaluates and checkpoints, how many
    steps an epoch of each phase holds (a new data stream each), and how long each event is before it ran."""

    cfg: PretrainConfig
    model: ModelConfig
    vocab_size: int
    world: int
    train_rows: dict[int, int]  # phase index -> training rows per worker (0: unknown, no epoch boundaries counted)
    heldout_rows: dict[int, int]  # phase index -> held-out rows per worker
    init_config: dict = field(default_factory=dict)  # pretrain.init's config.json (its shape), {} = the preset's

    def bounds(self) -> list[tuple[int, int]]:
        """(first step, last step) of each phase; a phase with no steps is (s, s - 1)."""
        out, start = [], 0
        for steps in self.cfg.phase_steps():
            out.append((start + 1, start + steps))
            start += steps
        return out

    def steps_per_epoch(self, q: int) -> int:
        phase = self.cfg.phases[q]
        accumulation = max(phase.accumulation(self.world), 1)
        rows = self.train_rows.get(q, 0)
        return (rows // phase.micro_batch_size) // accumulation if rows else 0

    def eval_batches(self, q: int) -> int:
        rows = self.heldout_rows.get(q, 0)
        batches = -(-rows // EVAL_BATCH) if rows else self.cfg.eval_max_batches
        return min(batches, self.cfg.eval_max_batches)


def _multiples(k: int, lo: int, hi: int) -> int:
    """How many multiples of k lie in [lo, hi] (0 for k = 0: never)."""
    return 0 if k <= 0 or hi < lo else hi // k - (lo - 1) // k


def seconds_left(s: Schedule, measured: Measurements, step: int, phase: int) -> float | None:
    """Seconds of work the workers have left after optimizer step `step` (taken in phase `phase`), counting
    whatever is scheduled at `step` itself (its evaluation, its checkpoint). None until a step was measured."""
    cfg = s.cfg
    phases = range(len(cfg.phases))
    # Phases with a steady step time; at the very start, whatever was measured.
    timed = ([q for q in phases if measured.steady_step(q) is not None]
             or [q for q in phases if measured.mean_step(q) is not None])
    if not timed:
        return None
    ref = phase if phase in timed else timed[-1]
    cost_per_s = step_cost(s.model, s.vocab_size, cfg.phases[ref], s.init_config) / measured.mean_step(ref)
    stream = measured.stream_start_s or 0.0

    def step_s(q: int) -> float:
        mean = measured.mean_step(q) if q == ref else measured.steady_step(q)
        return mean if mean is not None else step_cost(s.model, s.vocab_size, cfg.phases[q], s.init_config) / cost_per_s

    def eval_s(q: int) -> float:
        if q in measured.eval_s:
            return measured.eval_s[q]
        if q in measured.eval_batch_s:
            return s.eval_batches(q) * measured.eval_batch_s[q]
        # Its rows were read before training (streams.heldout_batches): only forward passes, about a third of a training
        # step per sequence; every worker evaluates its share of the rows.
        per_sequence = step_s(q) / (cfg.phases[q].global_batch_size / s.world)
        return s.eval_batches(q) * EVAL_BATCH * per_sequence / 3

    ckpt_bytes, export_bytes = state_bytes(s.model, s.vocab_size, s.init_config)
    per_rank = ckpt_bytes / s.world
    if measured.checkpoint_s is not None:  # the export writes the weights alone, at the speed a checkpoint was written
        checkpoint, export = measured.checkpoint_s, measured.checkpoint_s * export_bytes / per_rank
    else:
        checkpoint, export = per_rank / ASSUMED_BYTES_S, export_bytes / ASSUMED_BYTES_S

    total = 0.0
    bounds = s.bounds()
    for q, (first, last) in enumerate(bounds):
        n = last - first + 1
        if n <= 0 or last <= step:
            continue
        done = max(step - first + 1, 0)
        total += (n - done) * step_s(q)
        per_epoch = s.steps_per_epoch(q)
        # Each epoch opens a data stream, except a phase's first, opened before training (streams.WorkerData.open_all).
        if per_epoch:
            total += (-(-n // per_epoch) - max(-(-done // per_epoch), 1)) * stream
    for q, (first, last) in enumerate(bounds):  # evaluations and checkpoints from `step` on, before the last step
        lo, hi = max(step, first, 1), min(last, cfg.max_steps - 1)
        total += _multiples(cfg.eval_every_steps, lo, hi) * eval_s(q)
        total += _multiples(cfg.checkpoint_every_steps, lo, hi) * checkpoint
    # The end: the final evaluation (standard masks, at the last phase's length), the export, the last checkpoint.
    return total + eval_s(cfg.final_phase()) + export + checkpoint
