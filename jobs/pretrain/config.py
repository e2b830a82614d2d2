"""Typed configs of the pre-training stage: which BERT (ModelConfig) and how to train it (PretrainConfig).

Frozen, keyword-only: `configs/*.yaml` and `--set pretrain.zero_stage=3` fill them. Each `__post_init__` refuses
the impossible values and combinations when the config is built (at load, before any Ray worker starts), so a typo
costs seconds, not a cluster allocation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bertpipe.pipeline.framework.config_fields import above, at_least, one_of, path_field, sequence_length, within

# "from-init": the shape of the checkpoint `pretrain.init` names (its config.json); the config loader picks it when
# pretrain.init is set and no preset is named (jobs/pretrain/init.py).
FROM_INIT = "from-init"
MODEL_PRESETS = ("tiny", "bert-tiny", "mini", "base", "large", FROM_INIT)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    # A size from model.PRESETS, or "from-init" (the shape of pretrain.init's config.json); vocab_size always comes
    # from the vocabulary stage, never from here.
    preset: str = "tiny"
    # Recompute each layer in the backward pass: ~30% slower, much less activation memory (BERT-Large at 512).
    activation_checkpointing: bool = False
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    def __post_init__(self) -> None:
        one_of("model", self, "preset", MODEL_PRESETS)
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            within("model", self, name, 0.0, 1.0, high_open=True)


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

    def accumulation(self, workers: int) -> int:
        """Gradient accumulation steps at `workers` workers: the micro-batches each trains per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * workers)

    def __post_init__(self) -> None:
        section = "pretrain.phases[]"  # the index is not known here; the field and its value name the phase
        sequence_length(section, self)
        within(section, self, "max_predictions_per_seq", 1, self.max_seq_length)
        at_least(section, self, 1, "micro_batch_size", "global_batch_size")
        above(section, self, 0, "learning_rate")
        at_least(section, self, 0, "warmup_steps")


@dataclass(frozen=True, kw_only=True)
class PretrainConfig:
    # A pairs shard folder (seq_128/, seq_512/ ...) to train on instead of the pairs stage's output; its vocabulary
    # must then be given as vocab.path. Empty = the pairs stage's output.
    input: str = path_field()
    # A BERT to continue pre-training from: a Hugging Face folder (config.json, model.safetensors or
    # pytorch_model.bin, vocab.txt, optionally tokenizer_config.json), a local path or a URI every worker reads.
    # It sets vocab.path (its vocab.txt), vocab.lowercase (its casing) and the model's shape (model.preset
    # from-init); heads it lacks (MLM, NSP) start freshly initialised. Empty = random initialisation.
    init: str = path_field()
    # --- resources
    # A count, or a range [min, max]: elastic (jobs/pretrain/elastic.py). An elastic run starts on what the cluster
    # holds within the range, goes on with fewer workers when a node is lost and grows back when nodes join; the
    # global batch stays, gradient accumulation makes up the difference.
    num_workers: int | tuple[int, int] = 2
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
    # pad less (jobs/pretrain/data/length_binning.py); 1 = off. Batch sizes and rows per epoch do not change.
    length_bin_window: int = 8
    prefetch_batches: int = 4
    # --- logging, evaluation, checkpoints
    log_every_steps: int = 10
    eval_every_steps: int = 50  # held-out MLM/NSP accuracy; 0 = only at the end
    eval_max_batches: int = 20  # per worker
    checkpoint_every_steps: int = 50
    num_checkpoints_to_keep: int = 2
    # Training waits for a checkpoint's files to be written to local disk, not for their upload to storage (Ray
    # Train's asynchronous upload); false = it waits for the upload too. A drain's and the last checkpoint wait.
    async_checkpoint_upload: bool = True
    # With compile: torch.compile's cache saved beside every checkpoint and loaded on resume, so workers on a fresh
    # node do not compile from scratch (jobs/pretrain/checkpointing/compile_cache.py).
    compile_cache_in_checkpoint: bool = True
    # Workers start as forks of a process per node that has already imported torch, dynamo, DeepSpeed and MLflow
    # (jobs/pretrain/warm_start/): a restart's new processes skip ~8 s of imports each.
    warm_worker_start: bool = True
    max_failures: int = 3
    # Steps between two looks for a node of the run being drained (a spot notice: jobs/pretrain/drain.py); each look
    # is a barrier of all workers. 0 = never look.
    drain_check_every_steps: int = 5
    # An elastic run (num_workers a range): seconds between Ray Train's looks for room to grow.
    elastic_resize_check_s: float = 60.0
    # An elastic run: seconds a worker group may take to start before Ray Train tries again with what fits then
    # (a group sized by a node that is gone but whose raylet still answered never starts).
    elastic_start_timeout_s: float = 30.0
    # Ray Train storage (local path or s3://). Empty = <parent of the stage output>/ray_results, outside the
    # output folder (the workflow empties that before a rerun, and a rerun must find the checkpoints).
    storage_path: str = path_field()
    # Run name under storage_path; empty = derived from the fields that change the result (jobs/pretrain/runs.py),
    # so a rerun resumes unless one of them changed.
    run_name: str = ""
    # Start this run again from step 0 even though a checkpoint of the same settings exists (it is kept).
    restart: bool = False

    def __post_init__(self) -> None:
        """ValueError naming the key for every value and combination that cannot run (before any worker starts)."""
        self._check_ranges()
        self._check_steps()
        self._check_engine()
        self._check_lamb()
        self._check_phases()

    def phase_steps(self) -> tuple[int, ...]:
        """Optimizer steps of each phase; they sum to max_steps."""
        if len(self.phases) == 1:
            return (self.max_steps,)
        first = round(self.max_steps * self.phase1_fraction)
        return (first, self.max_steps - first)

    def final_phase(self) -> int:
        """The phase whose length the final held-out evaluation reads: the last one that has steps."""
        return len(self.phases) - 1 if self.phase_steps()[-1] else 0

    def _check_ranges(self) -> None:
        """Each field of this section in its range (a phase checks its own fields)."""
        self._check_workers()
        at_least("pretrain", self, 1, "cpus_per_worker", "max_steps", "log_every_steps",
                 "checkpoint_every_steps", "num_checkpoints_to_keep", "eval_max_batches", "prefetch_batches",
                 "length_bin_window")
        # gradient_clipping 0 = off; eval_every_steps 0 = only at the end
        at_least("pretrain", self, 0, "eval_every_steps", "max_failures", "drain_check_every_steps",
                 "elastic_resize_check_s", "elastic_start_timeout_s", "shuffle_buffer_rows", "weight_decay",
                 "gradient_clipping")
        within("pretrain", self, "phase1_fraction", 0.0, 1.0, low_open=True)
        within("pretrain", self, "masked_lm_prob", 0.0, 1.0, low_open=True, high_open=True)
        for name in ("beta1", "beta2"):
            within("pretrain", self, name, 0.0, 1.0, high_open=True)
        above("pretrain", self, 0, "eps", "decay_power")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"pretrain.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")

    def _check_workers(self) -> None:
        """num_workers: a count of at least 1, or a range [min, max] with 1 <= min <= max."""
        n = self.num_workers
        if isinstance(n, tuple) and (len(n) != 2 or not 1 <= n[0] <= n[1]):
            raise ValueError(f"pretrain.num_workers {list(n)} must be a count or a range [min, max] with "
                             "1 <= min <= max")
        if isinstance(n, int) and n < 1:
            raise ValueError(f"pretrain.num_workers must be at least 1, got {n}")

    @property
    def elastic(self) -> bool:
        """num_workers is a range: the worker count follows the cluster (jobs/pretrain/elastic.py)."""
        return isinstance(self.num_workers, tuple)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    def whole_batch_worlds(self) -> list[int]:
        """The worker counts within num_workers that every phase's global batch splits over exactly (global batch =
        micro-batch × workers × accumulation steps), smallest first."""
        return [n for n in range(self.min_workers, self.max_workers + 1)
                if all(ph.global_batch_size % (ph.micro_batch_size * n) == 0 for ph in self.phases)]

    def _check_steps(self) -> None:
        """One or two phases, and max_steps split so that every phase gets its share and phase 1 at least one."""
        if not 1 <= len(self.phases) <= 2:
            raise ValueError(f"pretrain.phases must hold 1 or 2 phases (seq 128, then 512), got {len(self.phases)}")
        steps = self.phase_steps()
        if len(steps) != len(self.phases) or sum(steps) != self.max_steps or min(steps) < 0:
            raise ValueError(f"pretrain phase steps {list(steps)} must be one non-negative count per phase summing "
                             f"to pretrain.max_steps {self.max_steps}")
        if steps[0] < 1:
            raise ValueError(f"pretrain phase 1 gets no steps (max_steps {self.max_steps}, phase1_fraction "
                             f"{self.phase1_fraction})")

    def _check_engine(self) -> None:
        """Optimizer implementation, offload and precision against the device."""
        if self.offload_optimizer and (self.zero_stage == 0 or self.optimizer_impl != "deepspeed"
                                       or not self.use_gpu or self.optimizer != "adamw"):
            raise ValueError("pretrain.offload_optimizer needs zero_stage >= 1, use_gpu, optimizer adamw and "
                             "optimizer_impl 'deepspeed' (DeepSpeed's CPU Adam)")
        if self.optimizer_impl == "deepspeed" and not self.use_gpu:
            raise ValueError("pretrain.optimizer_impl 'deepspeed' needs compiled ops and a GPU; use 'torch' on CPU")
        if not self.use_gpu and self.precision in ("bf16", "fp16"):
            raise ValueError(f"pretrain.precision {self.precision} needs use_gpu; CPU training runs in fp32")
        if self.use_gpu and self.precision == "fp16" and self.optimizer_impl == "torch" and self.zero_stage == 0:
            raise ValueError("pretrain.precision fp16 with zero_stage 0 needs optimizer_impl 'deepspeed' "
                             "(DeepSpeed's fp16 wrapper)")

    def _check_lamb(self) -> None:
        """LAMB's trust ratio must stay per layer: jobs/pretrain/engine/lamb_layout.py maps ZeRO 1/2 and bf16 partitions
        back to parameters; ZeRO 3 and DeepSpeed's own FusedLamb cannot be mapped (optimizer offload is refused by
        _check_engine)."""
        if self.optimizer != "lamb":
            return
        if self.zero_stage == 3:
            raise ValueError("pretrain.optimizer lamb with zero_stage 3 cannot be layer-wise (ZeRO-3 steps flat "
                             "sub-groups one at a time); use zero_stage 1 or 2")
        if self.optimizer_impl == "deepspeed":
            raise ValueError("pretrain.optimizer lamb with optimizer_impl 'deepspeed' (DeepSpeed's FusedLamb: one "
                             "clamped trust ratio per flat ZeRO/bf16 partition) is not layer-wise; use "
                             "optimizer_impl 'torch'")

    def _check_phases(self) -> None:
        """Lengths grow from phase to phase, and each phase's batch splits over the workers (over one worker count
        of an elastic range at least)."""
        previous = 0
        for i, ph in enumerate(self.phases):
            where = f"pretrain.phases[{i}]"
            if ph.max_seq_length <= previous:
                raise ValueError(f"{where}.max_seq_length {ph.max_seq_length} must grow from phase to phase")
            previous = ph.max_seq_length
            if self.elastic:
                continue
            per_step = ph.micro_batch_size * self.num_workers
            if ph.global_batch_size % per_step:
                raise ValueError(f"{where}.global_batch_size {ph.global_batch_size} is not divisible by num_workers "
                                 f"× micro_batch_size = {self.num_workers} × {ph.micro_batch_size} = {per_step}")
        if self.elastic and not self.whole_batch_worlds():
            batches = ", ".join(f"{ph.global_batch_size} in micro-batches of {ph.micro_batch_size}"
                                for ph in self.phases)
            raise ValueError(f"pretrain.num_workers {list(self.num_workers)}: no worker count in the range splits "
                             f"every phase's global batch ({batches}) exactly")


def bert_config(model: ModelConfig, vocab_size: int, init_config: dict | None = None, **fields):
    """The BertConfig a pre-training builds: that of the init's config.json (`init_config`, pretrain.init set), else
    the preset's, with this vocabulary's size and `fields` (dropout, activation checkpointing)."""
    import dataclasses

    from bertpipe.model import BertConfig

    if init_config:  # the checkpoint's shape in full (positions, eps: what a preset of its size may not match)
        return dataclasses.replace(BertConfig.from_hf_dict(init_config), vocab_size=vocab_size, **fields)
    if model.preset == FROM_INIT:
        raise ValueError("model.preset from-init needs pretrain.init (a BERT folder whose config.json gives the shape)")
    return BertConfig.preset(model.preset, vocab_size=vocab_size, **fields)


# Below this micro-batch at accumulation 1 the per-step overhead dominates a GPU step (measured on an H100,
# BERT-Large seq 128, bf16 ZeRO 1: 430 seq/s at micro 64 × accumulation 1 against 1,439 at micro 256).
MIN_GPU_MICRO_BATCH = 64


def layout_warning(cfg: PretrainConfig) -> str:
    """One line when a GPU phase ends at accumulation 1 with a micro-batch under MIN_GPU_MICRO_BATCH, else ''."""
    if not cfg.use_gpu:
        return ""
    small = [ph for ph, steps in zip(cfg.phases, cfg.phase_steps()) if steps
             and ph.global_batch_size == ph.micro_batch_size * cfg.max_workers
             and ph.micro_batch_size < MIN_GPU_MICRO_BATCH]
    if not small:
        return ""
    where = ", ".join(f"seq {ph.max_seq_length}: micro {ph.micro_batch_size} × accumulation 1" for ph in small)
    return (f"pretrain layout ({where}) leaves the GPU waiting on per-step overhead (H100, BERT-Large seq 128: "
            f"430 seq/s at micro 64 × accumulation 1, 1,439 at micro 256); use fewer workers with larger "
            f"micro_batch_size, or a larger global_batch_size")
