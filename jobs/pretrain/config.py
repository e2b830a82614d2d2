"""Typed configs of the pre-training stage: which BERT (ModelConfig) and how to train it (PretrainConfig).

Frozen, keyword-only: `configs/*.yaml` and `--set pretrain.zero_stage=3` fill them. `validate` catches the
impossible combinations before any Ray worker starts, so a typo costs seconds, not a cluster allocation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bertpipe.pipeline.config import path_field

MODEL_PRESETS = ("tiny", "bert-tiny", "mini", "base", "large")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    # A size from model.PRESETS; vocab_size always comes from the vocabulary stage, never from here.
    preset: str = "tiny"
    # Recompute each layer in the backward pass: ~30% slower, much less activation memory (BERT-Large at 512).
    activation_checkpointing: bool = False
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.preset not in MODEL_PRESETS:
            raise ValueError(f"model.preset {self.preset!r} is not one of {list(MODEL_PRESETS)}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class PhaseConfig:
    """One sequence-length phase. The paper trains 90% of the steps at 128 and the rest at 512."""

    max_seq_length: int = 128
    # ≈ 0.15 × max_seq_length: 20 at 128, 80 at 512 (google-research/bert, NVIDIA).
    max_predictions_per_seq: int = 20
    # Sequences per optimizer step over all workers (= micro_batch_size × workers × accumulation steps).
    global_batch_size: int = 32
    # Sequences per forward pass on one worker.
    micro_batch_size: int = 16
    # Peak learning rate of this phase (lr_schedule "phase") — with lr_schedule "run" only phase 1's counts.
    learning_rate: float = 1e-4
    warmup_steps: int = 10


@dataclass(frozen=True, kw_only=True)
class PretrainConfig:
    # A pairs shard folder (seq_128/, seq_512/ ...) to train on instead of the pairs stage's output; its vocabulary
    # must then be given as vocab.path. Empty = the pairs stage's output.
    input: str = path_field()
    # --- resources
    num_workers: int = 2
    use_gpu: bool = False
    cpus_per_worker: int = 1
    # --- steps and phases
    max_steps: int = 60
    # Fraction of max_steps spent in phase 1 (seq 128); the rest goes to phase 2 (seq 512). Ignored with one phase.
    phase1_fraction: float = 0.9
    phases: tuple[PhaseConfig, ...] = (
        PhaseConfig(),
        PhaseConfig(max_seq_length=512, max_predictions_per_seq=80, global_batch_size=8, micro_batch_size=4,
                    warmup_steps=0),
    )
    # "run": one warmup + decay over all steps with phase 1's lr and warmup (the paper's single schedule);
    # "phase": every phase warms up and decays on its own (NVIDIA's LAMB recipe restarts at phase 2).
    lr_schedule: Literal["run", "phase"] = "run"
    # 1.0 = linear decay to zero (paper); 0.5 = NVIDIA's polynomial decay for LAMB.
    decay_power: float = 1.0
    # --- optimizer
    optimizer: Literal["adamw", "lamb"] = "adamw"
    # "torch": torch.optim AdamW / our LAMB handed to DeepSpeed (no compiled ops: works on CPU);
    # "deepspeed": DeepSpeed builds its fused optimizer from the JSON (GPU; needed for optimizer offload).
    optimizer_impl: Literal["torch", "deepspeed"] = "torch"
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    # Applied to matrices and embeddings only; biases and LayerNorm parameters get none (as in the paper's code).
    weight_decay: float = 0.01
    gradient_clipping: float = 1.0
    # --- DeepSpeed
    zero_stage: int = 1  # 0 = plain data parallel; 1 shards optimizer state; 2 + gradients; 3 + parameters
    offload_optimizer: bool = False  # optimizer state and step on the CPU (needs optimizer_impl "deepspeed")
    # "auto" = bf16 on GPU, fp32 on CPU. fp16 uses dynamic loss scaling.
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # torch.compile the model through DeepSpeed's engine.compile(); None = on where use_gpu (measured on an H100:
    # +12% for BERT-Large at seq 128), off on CPU, where compiling takes longer than a short run saves.
    compile: bool | None = None
    # --- data
    masked_lm_prob: float = 0.15
    whole_word_masking: bool = False
    # Rows each worker mixes locally per epoch (the shards were already shuffled by the pairs stage).
    shuffle_buffer_rows: int = 2000
    # Micro-batches whose rows are sorted together by length before batching, so short rows share a batch and
    # pad less (jobs/length_binning.py); 1 = off. Batch sizes and rows per epoch do not change.
    length_bin_window: int = 8
    prefetch_batches: int = 4
    # --- logging, evaluation, checkpoints
    log_every_steps: int = 10
    eval_every_steps: int = 50  # held-out MLM/NSP accuracy; 0 = only at the end
    eval_max_batches: int = 20  # per worker
    checkpoint_every_steps: int = 50
    num_checkpoints_to_keep: int = 2
    max_failures: int = 3
    # Ray Train storage (local path or s3://). Empty = <parent of the stage output>/ray_results, outside the
    # output folder (the workflow empties that before a rerun, and a rerun must find the checkpoints).
    storage_path: str = path_field()
    # Run name under storage_path; empty = derived from the config and inputs, so an identical rerun resumes.
    run_name: str = ""

    def phase_steps(self) -> tuple[int, ...]:
        """Optimizer steps of each phase; they sum to max_steps."""
        if len(self.phases) == 1:
            return (self.max_steps,)
        first = round(self.max_steps * self.phase1_fraction)
        return (first, self.max_steps - first)


# Below this micro-batch at accumulation 1 the per-step overhead dominates a GPU step (measured on an H100,
# BERT-Large seq 128, bf16 ZeRO 1: 430 seq/s at micro 64 × accumulation 1 against 1,439 at micro 256).
MIN_GPU_MICRO_BATCH = 64


def layout_warning(cfg: PretrainConfig) -> str:
    """One line when a GPU phase ends at accumulation 1 with a micro-batch under MIN_GPU_MICRO_BATCH, else ''."""
    if not cfg.use_gpu:
        return ""
    small = [ph for ph, steps in zip(cfg.phases, cfg.phase_steps()) if steps
             and ph.global_batch_size == ph.micro_batch_size * cfg.num_workers
             and ph.micro_batch_size < MIN_GPU_MICRO_BATCH]
    if not small:
        return ""
    where = ", ".join(f"seq {ph.max_seq_length}: micro {ph.micro_batch_size} × accumulation 1" for ph in small)
    return (f"pretrain layout ({where}) leaves the GPU waiting on per-step overhead (H100, BERT-Large seq 128: "
            f"430 seq/s at micro 64 × accumulation 1, 1,439 at micro 256); use fewer workers with larger "
            f"micro_batch_size, or a larger global_batch_size")


def _check_lamb(cfg: PretrainConfig, bad) -> None:
    """LAMB's trust ratio must stay per layer: jobs/pretrain/lamb_layout.py maps ZeRO 1/2 and bf16 partitions back
    to parameters; ZeRO 3 and DeepSpeed's own FusedLamb cannot be mapped (optimizer offload is refused below)."""
    if cfg.optimizer != "lamb":
        return
    if cfg.zero_stage == 3:
        bad("optimizer lamb with zero_stage 3 cannot be layer-wise (ZeRO-3 steps flat sub-groups one at a time); "
            "use zero_stage 1 or 2")
    if cfg.optimizer_impl == "deepspeed":
        bad("optimizer lamb with optimizer_impl 'deepspeed' (DeepSpeed's FusedLamb: one clamped trust ratio per "
            "flat ZeRO/bf16 partition) is not layer-wise; use optimizer_impl 'torch'")


def validate(cfg: PretrainConfig) -> None:
    """ValueError naming the key for every combination that cannot run (before any worker starts)."""
    def bad(msg: str) -> None:
        raise ValueError(f"pretrain config: {msg}")

    if cfg.num_workers < 1 or cfg.cpus_per_worker < 1:
        bad(f"num_workers ({cfg.num_workers}) and cpus_per_worker ({cfg.cpus_per_worker}) must be >= 1")
    if cfg.max_steps < 1:
        bad(f"max_steps must be >= 1, got {cfg.max_steps}")
    if not 1 <= len(cfg.phases) <= 2:
        bad(f"phases must hold 1 or 2 phases (seq 128, then 512), got {len(cfg.phases)}")
    if not 0.0 < cfg.phase1_fraction <= 1.0:
        bad(f"phase1_fraction must be in (0, 1], got {cfg.phase1_fraction}")
    steps = cfg.phase_steps()
    if len(steps) != len(cfg.phases) or sum(steps) != cfg.max_steps or min(steps) < 0:
        bad(f"phase steps {list(steps)} must be one non-negative count per phase summing to max_steps "
            f"{cfg.max_steps}")
    if steps[0] < 1:
        bad(f"phase 1 gets no steps (max_steps {cfg.max_steps}, phase1_fraction {cfg.phase1_fraction})")
    if cfg.zero_stage not in (0, 1, 2, 3):
        bad(f"zero_stage must be 0, 1, 2 or 3, got {cfg.zero_stage}")
    if cfg.offload_optimizer and (cfg.zero_stage == 0 or cfg.optimizer_impl != "deepspeed"
                                  or not cfg.use_gpu or cfg.optimizer != "adamw"):
        bad("offload_optimizer needs zero_stage >= 1, use_gpu, optimizer adamw and optimizer_impl 'deepspeed' "
            "(DeepSpeed's CPU Adam)")
    _check_lamb(cfg, bad)
    if cfg.optimizer_impl == "deepspeed" and not cfg.use_gpu:
        bad("optimizer_impl 'deepspeed' needs compiled ops and a GPU; use 'torch' on CPU")
    if not cfg.use_gpu and cfg.precision in ("bf16", "fp16"):
        bad(f"precision {cfg.precision} needs use_gpu; CPU training runs in fp32")
    if cfg.use_gpu and cfg.precision == "fp16" and cfg.optimizer_impl == "torch" and cfg.zero_stage == 0:
        bad("fp16 with zero_stage 0 needs optimizer_impl 'deepspeed' (DeepSpeed's fp16 wrapper)")
    for name in ("log_every_steps", "checkpoint_every_steps", "num_checkpoints_to_keep", "eval_max_batches",
                 "prefetch_batches", "length_bin_window"):
        if getattr(cfg, name) < 1:
            bad(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.eval_every_steps < 0 or cfg.max_failures < 0 or cfg.shuffle_buffer_rows < 0:
        bad("eval_every_steps, max_failures and shuffle_buffer_rows must be >= 0")
    _check_numbers(cfg, bad)
    _check_phases(cfg, bad)


def _check_numbers(cfg: PretrainConfig, bad) -> None:
    """Optimizer and masking numbers in their ranges."""
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            bad(f"{name} must be in [0, 1), got {getattr(cfg, name)}")
    if cfg.eps <= 0:
        bad(f"eps must be > 0, got {cfg.eps}")
    for name in ("weight_decay", "gradient_clipping"):  # gradient_clipping 0 = off
        if getattr(cfg, name) < 0:
            bad(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if not 0.0 < cfg.masked_lm_prob < 1.0:
        bad(f"masked_lm_prob must be in (0, 1), got {cfg.masked_lm_prob}")
    if cfg.decay_power <= 0:
        bad(f"decay_power must be > 0, got {cfg.decay_power}")


def _check_phases(cfg: PretrainConfig, bad) -> None:
    """Each phase's lengths, batch sizes and schedule, and that the batch splits over the workers."""
    previous = 0
    for i, ph in enumerate(cfg.phases, 1):
        where = f"phases[{i - 1}]"
        if ph.max_seq_length < 8 or ph.max_seq_length > 512:
            bad(f"{where}.max_seq_length must be in [8, 512] (BERT's position table), got {ph.max_seq_length}")
        if ph.max_seq_length <= previous:
            bad(f"{where}.max_seq_length {ph.max_seq_length} must grow from phase to phase")
        previous = ph.max_seq_length
        if not 1 <= ph.max_predictions_per_seq <= ph.max_seq_length:
            bad(f"{where}.max_predictions_per_seq must be in [1, max_seq_length], got {ph.max_predictions_per_seq}")
        for name in ("micro_batch_size", "global_batch_size"):
            if getattr(ph, name) < 1:
                bad(f"{where}.{name} must be >= 1, got {getattr(ph, name)}")
        per_step = ph.micro_batch_size * cfg.num_workers
        if ph.global_batch_size % per_step:
            bad(f"{where}.global_batch_size {ph.global_batch_size} is not divisible by num_workers × "
                f"micro_batch_size = {cfg.num_workers} × {ph.micro_batch_size} = {per_step}")
        if ph.learning_rate <= 0 or ph.warmup_steps < 0:
            bad(f"{where}: learning_rate must be > 0 and warmup_steps >= 0")
