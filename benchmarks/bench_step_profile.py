"""Where the CPU time of a pre-training step goes: torch.profiler operator calls and CPU milliseconds per
micro-step (forward + backward + the loop's bookkeeping, inside an accumulation) and per optimizer step
(`engine.step()` at the boundary: gradient norm, clipping, optimizer, LR update), and host reads of tensor values
(aten::_local_scalar_dense: each one waits for the GPU), on the mini model at seq 128, for ZeRO 1 and 2 × AdamW
and LAMB — in one process, one rank (gloo), no Ray. `--precision bf16` (default) builds DeepSpeed's bf16
configuration as on a GPU (DeepSpeed runs it on the CPU too); `fp32` the CPU configuration.

On a GPU the host issues every one of these operators; when the host is slower than the device the GPU idles, so
fewer operators and fewer host milliseconds are the figure that carries over. Run it once on this checkout and
once on another (the reference), and compare:

    python benchmarks/bench_step_profile.py                       # this checkout
    git worktree add /tmp/ref 3c5261c && mkdir -p /tmp/refpkg/bertpipe && for d in pipeline model jobs; do \
        ln -sfn /tmp/ref/$d /tmp/refpkg/bertpipe/$d; done
    PYTHONPATH=/tmp/refpkg python benchmarks/bench_step_profile.py --label reference --json /tmp/ref.json
    python benchmarks/bench_step_profile.py --compare /tmp/ref.json   # both side by side, with ratios

The reference code path (before `build_engine` existed, now engine.py's) is rebuilt here line for line from 3c5261c's
`loop.setup`, `Meter.add` and the progress line's `out.loss.item()`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "tests"))

ACCUM, MICRO, L, P = 4, 16, 128, 20
CONFIGS = [(1, "adamw"), (2, "adamw"), (1, "lamb"), (2, "lamb")]


def build(zero: int, optimizer: str, precision: str):
    """(worker, new_api) for the code on the path: this checkout's build_engine, or the reference's setup."""
    import dataclasses

    import torch

    import engine_helpers as eh
    from bertpipe.jobs.pretrain import loop
    from bertpipe.jobs.pretrain.config import ModelConfig, PhaseConfig, PretrainConfig
    from bertpipe.jobs.services.tracking import RunLogger

    cfg = PretrainConfig(num_workers=1, zero_stage=zero, optimizer=optimizer, max_steps=100,
                         phases=(PhaseConfig(max_seq_length=L, max_predictions_per_seq=P,
                                             global_batch_size=MICRO * ACCUM, micro_batch_size=MICRO),))
    model = ModelConfig(preset="mini", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    vocab = eh.h.SPECIALS + [f"w{i}" for i in range(8192 - len(eh.h.SPECIALS))]
    if _current():
        return eh.worker(cfg, model=model, vocab=vocab, precision=precision), True
    import deepspeed

    from bertpipe.jobs.pretrain.engine import deepspeed_config as dsc
    from bertpipe.jobs.pretrain.engine.deepspeed_config import deepspeed_config

    if precision == "bf16":  # the reference's GPU JSON (bf16 with DeepSpeed's overflow check), built on the CPU
        dsc.resolved_precision = lambda c: "bf16"
    from bertpipe.jobs.pretrain.engine.lamb_layout import attach_lamb_layouts
    from bertpipe.jobs.pretrain.engine.optim import make_optimizer, make_scheduler

    net = loop.build_model(model, len(vocab), 7)
    engine, _, _, scheduler = deepspeed.initialize(
        model=net, optimizer=make_optimizer(cfg, net), config=deepspeed_config(cfg, cfg.phases[0], 1),
        dist_init_required=False, lr_scheduler=lambda opt: make_scheduler(cfg, opt))
    if optimizer == "lamb":
        attach_lamb_layouts(engine)
    spec = dataclasses.replace(loop.WorkerSpec(pretrain=cfg, model=model, seed=7, vocab_tokens=vocab,
                                               vocab_bytes=b"", tracking={}, export_uri="", storage_path="",
                                               run_name="bench"))
    return loop.Worker(spec, engine, scheduler, 0, 1, torch.device("cpu"), RunLogger({}, enabled=False)), False


def _current() -> bool:
    """The code under test has the engine apart from the loop (engine.py): the current code path, not 3c5261c's."""
    import importlib.util

    return importlib.util.find_spec("bertpipe.jobs.pretrain.engine") is not None


def micro_step(w, meter, raw, index, new_api, boundary_timer):
    """What loop.run_epoch does for one micro-batch, with engine.step() at a boundary timed apart."""
    from bertpipe.jobs.pretrain.data.masking import batch_rng, mask_batch

    if _current():
        from bertpipe.jobs.pretrain import worker as helpers
    else:  # the reference commit kept the batch helpers in loop.py
        from bertpipe.jobs.pretrain import loop as helpers
    spec = helpers.masking_spec(w, w.spec.pretrain.phases[0])
    batch = mask_batch(raw, spec, batch_rng(1, 0, 0, 0, index))
    if new_api:
        batch = helpers.to_device(batch, w.device)
    out = helpers.forward(w, batch)
    w.engine.backward(out.loss)
    boundary = w.engine.is_gradient_accumulation_boundary()
    with boundary_timer(boundary):
        w.engine.step()
    if new_api:
        meter.add(out, batch["attention_mask"], 0.0)
        if boundary:
            meter.end_step(w.engine.global_steps, w.engine.get_global_grad_norm())
    else:
        meter.add(out, batch, 0.0)
        if boundary:
            out.loss.item()  # the reference's progress line
    return boundary


def profile(zero: int, optimizer: str, steps: int, precision: str) -> dict:
    from contextlib import contextmanager, nullcontext

    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    import engine_helpers as eh
    from bertpipe.jobs.pretrain.metrics.meter import Meter

    with eh.process_group():
        w, new_api = build(zero, optimizer, precision)
        w.engine.set_train_micro_batch_size(MICRO)
        w.engine.set_train_batch_size(MICRO * ACCUM)
        meter = Meter(w.device) if new_api else Meter()
        raws = eh.raw_batches(ACCUM * (steps + 2), MICRO, L)
        for i, raw in enumerate(raws[: 2 * ACCUM]):  # warm-up: optimizer state, DeepSpeed buffers
            micro_step(w, meter, raw, i, new_api, lambda b: nullcontext())
        spans = {"micro": [], "optimizer": []}

        @contextmanager
        def step_span(boundary):
            started = time.perf_counter()
            with torch.profiler.record_function("optimizer_step" if boundary else "accumulate"):
                yield
            if boundary:
                spans["optimizer"].append(time.perf_counter() - started)

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for i, raw in enumerate(raws[2 * ACCUM:], start=2 * ACCUM):
                started = time.perf_counter()
                with torch.profiler.record_function("micro_step"):
                    boundary = micro_step(w, meter, raw, i, new_api, step_span)
                if not boundary:
                    spans["micro"].append(time.perf_counter() - started)
    return {"zero": zero, "optimizer": optimizer, **op_counts(prof, steps), **{
        "micro_ms": 1e3 * sorted(spans["micro"])[len(spans["micro"]) // 2],
        "step_ms": 1e3 * sorted(spans["optimizer"])[len(spans["optimizer"]) // 2]}}


def op_counts(prof, steps: int) -> dict:
    """Operator calls (aten:: and DeepSpeed/torch distributed calls) per accumulation micro-step and per optimizer
    step: every operator event inside the labelled ranges, by time containment."""
    events = prof.events()
    ranges = {name: [(e.time_range.start, e.time_range.end) for e in events if e.name == name]
              for name in ("micro_step", "optimizer_step")}
    ops = [e for e in events if e.name.startswith(("aten::", "c10d::", "gloo:"))]

    def inside(spans, e):
        return any(s <= e.time_range.start and e.time_range.end <= t for s, t in spans)

    # only top-level operators (not the aten calls an aten call makes), so a count is "calls the host made"
    top = [e for e in ops if e.cpu_parent is None or not e.cpu_parent.name.startswith(("aten::", "c10d::"))]
    in_step = [e for e in top if inside(ranges["optimizer_step"], e)]
    micro_total = len([e for e in top if inside(ranges["micro_step"], e)]) - len(in_step)
    micro_count, step_count = len(ranges["micro_step"]), max(len(ranges["optimizer_step"]), 1)
    # A host read of a tensor's value (item, float(), bool(), tolist) runs aten::_local_scalar_dense: on a GPU
    # each one waits for every queued kernel.
    reads = [e for e in events if e.name == "aten::_local_scalar_dense"]
    step_reads = len([e for e in reads if inside(ranges["optimizer_step"], e)])
    micro_reads = len([e for e in reads if inside(ranges["micro_step"], e)]) - step_reads
    return {"micro_ops": micro_total / micro_count, "step_ops": len(in_step) / step_count,
            "micro_reads": micro_reads / micro_count, "step_reads": step_reads / step_count}


def table(rows: list[dict], ref: list[dict] | None) -> str:
    head = ("| ZeRO | optimizer | micro-step ops | micro-step host reads | micro-step CPU ms | optimizer-step ops "
            "| optimizer-step host reads | optimizer-step CPU ms |")
    lines = [head, "|" + "---|" * 8]
    by_key = {(r["zero"], r["optimizer"]): r for r in ref or []}
    for r in rows:
        old = by_key.get((r["zero"], r["optimizer"]))

        def cell(key, fmt):
            now = format(r[key], fmt)
            if not old or key not in old:
                return now
            ratio = f" ({r[key] / old[key]:.2f}×)" if old[key] else ""
            return f"{format(old[key], fmt)} → {now}{ratio}"

        lines.append(f"| {r['zero']} | {r['optimizer']} | {cell('micro_ops', '.0f')} | {cell('micro_reads', '.2f')} | "
                     f"{cell('micro_ms', '.1f')} | {cell('step_ops', '.0f')} | {cell('step_reads', '.2f')} | "
                     f"{cell('step_ms', '.1f')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps profiled per configuration")
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                    help="bf16: DeepSpeed's GPU configuration, run on the CPU; fp32: the CPU configuration")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--compare", help="figures of a reference run (--json) to print beside these, with ratios")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = [profile(zero, opt, args.steps, args.precision) for zero, opt in CONFIGS]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    ref = json.loads(Path(args.compare).read_text()) if args.compare else None
    print(f"\nmini BERT (4 × 256), seq {L}, micro {MICRO} × accumulation {ACCUM}, {args.precision} on the CPU, "
          f"1 thread; "
          f"{args.label}{' (reference → this checkout)' if ref else ''}; medians over {args.steps} steps")
    print(table(rows, ref))


if __name__ == "__main__":
    main()
