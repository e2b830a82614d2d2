"""The pre-training step path on CPU, without Ray (one process, gloo, the engine engine.build_engine builds):
nothing reads a device tensor to the host between two logging windows, a non-finite loss or gradient norm stops
the run with one line naming the step, bf16 drops DeepSpeed's per-gradient overflow check, and a compiled model
computes what the eager one does."""
from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch

import engine_helpers as eh
from bertpipe.jobs.pretrain import loop, worker
from bertpipe.jobs.pretrain.checkpointing.resume import Position
from bertpipe.jobs.pretrain.engine.build import compile_enabled
from bertpipe.jobs.pretrain.data.masking import MaskingSpec, batch_rng, mask_batch, round_up
from bertpipe.jobs.pretrain.config import PhaseConfig, PretrainConfig, layout_warning
from bertpipe.jobs.pretrain.engine.deepspeed_config import deepspeed_config
from bertpipe.jobs.pretrain.metrics.meter import Meter, NonFiniteError

REPO = str(Path(__file__).resolve().parents[1])
# Every way a tensor's value reaches Python: each waits for the device's queue on a GPU.
HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


class HostReads:
    """Counts host reads of tensors while active, with the innermost project or DeepSpeed frame of each; reads
    made inside `allowed` functions (the logging window) are not counted."""

    def __init__(self, allowed=("log_window",)):
        self.allowed, self.calls, self.active = set(allowed), collections.Counter(), False
        self.originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def _wrap(self, name, original):
        def counted(tensor, *args, **kwargs):
            if self.active:
                stack = traceback.extract_stack()[:-1]
                site = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                             for f in reversed(stack) if f.filename.startswith(REPO) or "site-packages" in f.filename),
                            "?")
                # torch's optimizers keep their step counters on the CPU (non-capturable), so reading one never
                # waits for the device; on a GPU the product uses fused AdamW, which reads none.
                if not any(f.name in self.allowed for f in stack) and "optimizer.py" not in site.split(":")[0][-12:]:
                    self.calls[(name, site)] += 1
            return original(tensor, *args, **kwargs)
        return counted

    def __enter__(self):
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)

    def ours(self):
        """Reads made by the project's own code (the innermost frame outside the libraries is ours)."""
        return {k: v for k, v in self.calls.items() if "site-packages" not in k[1] and not k[1].startswith(
            ("deepspeed", "torch"))}


def config(**kw) -> PretrainConfig:
    base = dict(num_workers=1, max_steps=12, log_every_steps=6, checkpoint_every_steps=10**6,
                eval_every_steps=0, zero_stage=1, length_bin_window=1,
                phases=(PhaseConfig(max_seq_length=32, max_predictions_per_seq=5, global_batch_size=16,
                                    micro_batch_size=4, learning_rate=1e-3, warmup_steps=2),))
    base.update(kw)
    return PretrainConfig(**base)


def train(w, cfg, batches, steps=None):
    """run_epoch over `batches` with the phase set up as run_phase sets it; returns (position, last window's
    figures)."""
    loop.start_phase(w, 0)
    position = loop.run_epoch(w, Position(), steps or cfg.max_steps, batches)
    return position, w.metrics.last_window


@pytest.mark.parametrize("precision, zero, optimizer", [("bf16", 1, "adamw"), ("bf16", 2, "lamb"),
                                                        ("fp32", 1, "adamw")])
def test_no_host_reads_between_logging_windows(precision, zero, optimizer):
    cfg = config(zero_stage=zero, optimizer=optimizer)
    with eh.process_group():
        w = eh.worker(cfg, precision=precision)
        batches = eh.raw_batches(4 * cfg.max_steps, 4, 32)
        with HostReads() as reads:
            reads.active = True
            position, last = train(w, cfg, batches)
    assert position.step == cfg.max_steps and w.engine.gradient_accumulation_steps() == 4
    assert 0 < last["loss"] < 10 and len(w.metrics.history) == 2  # two windows were logged (and read) normally
    assert reads.ours() == {}, reads.ours()
    if precision == "bf16":  # the GPU configuration: DeepSpeed's step reads nothing either
        assert dict(reads.calls) == {}, dict(reads.calls)
    else:  # fp32 keeps DeepSpeed's invalid-norm check (not switchable): at most one read per optimizer step
        assert sum(reads.calls.values()) <= cfg.max_steps, dict(reads.calls)


def test_bf16_json_has_no_overflow_check_and_fp16_keeps_loss_scaling():
    gpu = PretrainConfig(use_gpu=True, precision="bf16", num_workers=1,
                         phases=(PhaseConfig(global_batch_size=256, micro_batch_size=256),))  # valid, or it raises
    ds = deepspeed_config(gpu, gpu.phases[0], 1)
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": False} and not ds["fp16"]["enabled"]
    fp16 = deepspeed_config(PretrainConfig(use_gpu=True, precision="fp16", num_workers=1), gpu.phases[0], 1)
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0 and fp16["bf16"] == {"enabled": False}


@pytest.mark.parametrize("what", ["loss", "global gradient norm"])
def test_non_finite_stops_at_the_window_naming_the_step(what):
    cfg = config()
    with eh.process_group():
        w = eh.worker(cfg, precision="bf16")
        batches = eh.raw_batches(4 * cfg.max_steps, 4, 32)
        bad_from = 3  # optimizer step whose micro-batches go bad

        def poisoned():
            for i, raw in enumerate(batches):
                if i == 4 * (bad_from - 1):
                    if what == "loss":
                        w.engine.module.nsp.weight.data.fill_(float("nan"))  # every later loss is NaN
                    else:  # the loss stays finite, one gradient does not
                        w.engine.module.nsp.bias.register_hook(lambda g: g * float("inf"))
                yield raw

        with pytest.raises(NonFiniteError) as err:
            train(w, cfg, poisoned())
    message = str(err.value)
    assert "\n" not in message and f"not finite at optimizer step {bad_from}" in message
    assert message.startswith(f"pretrain (seq 32): the {what}")
    assert len(w.metrics.history) == 0  # found at the first window (step 6), nothing logged for it


def test_meter_sums_what_the_model_returned():
    """The device-side sums equal the per-micro-batch figures read one by one."""
    cfg = config(max_steps=6)
    with eh.process_group():
        w = eh.worker(cfg)
        meter = Meter(w.device)
        outs, spec = [], worker.masking_spec(w, cfg.phases[0])
        for i, raw in enumerate(eh.raw_batches(3, 4, 32)):
            batch = worker.to_device(mask_batch(raw, spec, batch_rng(1, 0, 0, 0, i)), w.device)
            with torch.no_grad():
                out = worker.forward(w, batch)
            meter.add(out, batch["attention_mask"], 0.0)
            outs.append((out, int(batch["attention_mask"].sum())))
        s = meter.summary(1)
    assert s["loss"] == pytest.approx(sum(o.loss.item() for o, _ in outs) / 3, rel=1e-6)
    assert s["mlm_accuracy"] == pytest.approx(sum(o.mlm_correct.item() for o, _ in outs)
                                              / sum(o.mlm_count.item() for o, _ in outs))
    assert s["nsp_accuracy"] == pytest.approx(sum(o.nsp_correct.item() for o, _ in outs) / 12)
    assert 0 < s["padding_fraction"] < 1
    assert s["tokens_per_second"] > 0 and sum(n for _, n in outs) > 0


def test_layout_warning_names_small_accumulation_one_phases():
    one = PretrainConfig(use_gpu=True, precision="bf16", num_workers=16, max_steps=100,
                         phases=(PhaseConfig(global_batch_size=256, micro_batch_size=16),))
    assert "micro 16 × accumulation 1" in layout_warning(one) and "\n" not in layout_warning(one)
    assert layout_warning(PretrainConfig(use_gpu=True, num_workers=4, max_steps=100,
                                         phases=(PhaseConfig(global_batch_size=256, micro_batch_size=16),))) == ""
    assert layout_warning(PretrainConfig(num_workers=16, max_steps=100,  # CPU: no warning
                                         phases=(PhaseConfig(global_batch_size=256, micro_batch_size=16),))) == ""


def test_compiled_and_eager_losses_agree_and_every_length_runs_one_graph():
    """pretrain.compile on the tiny model: the same losses as eager over a few steps (inductor on CPU), and micro-
    batches of two padded lengths run one compiled graph (worker.forward: dynamic from the first step)."""
    from torch._dynamo.utils import counters

    batches = eh.raw_batches(12, 4, 32)
    assert len({round_up(max(len(r) for r in b["input_ids"]), MaskingSpec.pad_to_multiple_of) for b in batches}) == 2
    losses = {}
    for compiled in (False, True):
        cfg = config(compile=compiled, max_steps=3, log_every_steps=3)
        torch._dynamo.reset()
        counters.clear()
        with eh.process_group():
            w = eh.worker(cfg)
            train(w, cfg, batches)
        losses[compiled] = [row["loss"] for row in w.metrics.history]
        assert w.compiled == compiled
        assert counters["stats"]["unique_graphs"] == (1 if compiled else 0)
    assert losses[True] == pytest.approx(losses[False], rel=2e-3)


@pytest.mark.parametrize("preset", ["bert_large", "bert_large_lamb"])
def test_gpu_presets_fill_the_card(preset):
    """The GPU presets load, validate, reach their recipe's global batch and never sit at accumulation 1 with a
    micro-batch under 64 at seq 128; they compile on the GPU."""
    from bertpipe.jobs.config import load_config

    cfg = load_config(preset).pretrain  # loading checks every value and combination
    assert cfg.use_gpu and compile_enabled(cfg) and layout_warning(cfg) == ""
    first = cfg.phases[0]
    assert first.max_seq_length == 128 and first.micro_batch_size >= 64
    assert first.global_batch_size == {"bert_large": 256, "bert_large_lamb": 65536}[preset]
    assert deepspeed_config(cfg, first, cfg.num_workers)["bf16"]["check_grad_overflow"] is False


def test_zero0_without_a_norm_trains_on():
    """DeepSpeed keeps no global gradient norm at ZeRO 0 in fp32 (None): not taken for a non-finite one."""
    cfg = config(zero_stage=0, max_steps=6, log_every_steps=3)
    with eh.process_group():
        w = eh.worker(cfg)
        position, last = train(w, cfg, eh.raw_batches(4 * cfg.max_steps, 4, 32))
    assert w.engine.get_global_grad_norm() is None
    assert position.step == 6 and len(w.metrics.history) == 2 and last["loss"] > 0


def test_progress_says_once_what_the_work_is_doing(capsys):
    """A status (e.g. 'compiling the model') is printed at once when it changes, not repeated on every poll."""
    from bertpipe.pipeline.framework.console import Console

    console = Console(live=True)
    try:
        shown = console.progress("pretrain", 40, "steps")
        for _ in range(3):  # the driver's poll hands the same fields over and over
            shown.set(0, status="compiling the model (torch.compile, first step)")
        shown.set(0, status="model compiled in 12 s")
    finally:
        console.close()
    lines = [l for l in capsys.readouterr().out.splitlines() if l.strip()]
    assert lines == ["  pretrain: compiling the model (torch.compile, first step)",
                     "  pretrain: model compiled in 12 s"]
