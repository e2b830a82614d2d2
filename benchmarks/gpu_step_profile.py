"""Where a pre-training step's time goes on a GPU: the product's engine (engine.build_engine: DeepSpeed bf16, ZeRO,
torch fused AdamW or our LAMB, engine.compile()) driven the way loop.run_epoch drives it (mask_batch → pinned copy →
forward/backward/step → Meter), one rank, no Ray, no data loading. Per configuration it prints sequences/s (no
profiler), then from a torch.profiler trace per optimizer step: host (CPU) milliseconds, GPU busy milliseconds
(kernels + copies, merged), kernel launches, and host waits for the device (aten::_local_scalar_dense and
cudaStreamSynchronize / cudaDeviceSynchronize / blocking cudaMemcpy calls). Host ms above GPU ms means the GPU idles
waiting for the host; GPU busy well below wall means host waits or launches dominate.

    python benchmarks/gpu_step_profile.py --configs 1:adamw:256:1,2:adamw:256:1,1:lamb:256:1 [--seq 128]

Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "tests"))
sys.path.append(str(REPO / "benchmarks"))

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def build(zero: int, optimizer: str, micro: int, accum: int, seq: int, preset: str, compile_model: bool,
          device: str):
    import torch

    import pretrain_helpers as h
    from bertpipe.jobs.pretrain.config import ModelConfig, PhaseConfig, PretrainConfig
    from bertpipe.jobs.pretrain.engine.build import build_engine
    from bertpipe.jobs.pretrain.worker import Worker
    from bertpipe.jobs.pretrain.worker_spec import WorkerSpec
    from bertpipe.jobs.services.tracking import RunLogger

    gpu = device == "cuda"
    cfg = PretrainConfig(num_workers=1, use_gpu=gpu, precision="bf16" if gpu else "auto", zero_stage=zero,
                         optimizer=optimizer, compile=compile_model, max_steps=10**6, log_every_steps=10**6,
                         phases=(PhaseConfig(max_seq_length=seq, max_predictions_per_seq=max(20, seq * 20 // 128),
                                             global_batch_size=micro * accum, micro_batch_size=micro,
                                             learning_rate=1e-4, warmup_steps=10),))
    model = ModelConfig(preset=preset)
    vocab = h.SPECIALS + [f"w{i}" for i in range(30_522 - len(h.SPECIALS))]
    engine, scheduler = build_engine(cfg, model, len(vocab), 7, 1)
    spec = WorkerSpec(pretrain=cfg, model=model, seed=7, vocab_tokens=vocab, vocab_bytes=b"", tracking={},
                           export_uri="", storage_path="", run_name="gpu-profile")
    w = Worker.build(spec, engine, scheduler, 0, 1, torch.device(device), RunLogger({}, enabled=False))
    engine.set_train_micro_batch_size(micro)
    engine.set_train_batch_size(micro * accum)
    return w


def micro_step(w, meter, raw, index):
    """loop.run_epoch's body for one micro-batch; True at an optimizer step."""
    import time as _t

    from bertpipe.jobs.pretrain import loop
    from bertpipe.jobs.pretrain.data.masking import batch_rng, mask_batch
    from bertpipe.jobs.pretrain.worker import masking_spec, to_device

    started = _t.perf_counter()
    phase = w.spec.pretrain.phases[0]
    batch = to_device(mask_batch(raw, masking_spec(w, phase), batch_rng(1, 0, 0, 0, index)), w.device)
    before = w.engine.global_steps
    out = loop.train_step(w, batch, index)
    meter.add(out, batch["attention_mask"], _t.perf_counter() - started)
    if w.engine.global_steps != before:
        meter.end_step(w.engine.global_steps, w.engine.get_global_grad_norm())
        return True
    return False


def merged_busy_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def profile_config(zero: int, optimizer: str, micro: int, accum: int, args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import engine_helpers as eh
    import gpu_model_bench as g
    from bertpipe.jobs.pretrain.metrics.meter import Meter
    from bertpipe.model import BertConfig

    started = time.perf_counter()
    w = build(zero, optimizer, micro, accum, args.seq, args.preset, not args.no_compile, args.device)
    meter = Meter(w.device)
    raws = eh.raw_batches(accum * 2, micro, args.seq)
    # shard rows from pretrain_helpers use ids below its small test vocabulary: fine for speed
    i = 0

    def run_steps(n: int) -> None:
        nonlocal i
        done = 0
        while done < n:
            done += micro_step(w, meter, raws[i % len(raws)], i)
            i += 1

    run_steps(args.warmup)
    meter.summary(1)
    meter.reset()
    warm_s = time.perf_counter() - started
    g.sync(args.device)
    t0 = time.perf_counter()
    run_steps(args.steps)
    meter.summary(1)  # the window's one host read, as log_window does
    g.sync(args.device)
    step_s = (time.perf_counter() - t0) / args.steps
    meter.reset()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t1 = time.perf_counter()
        run_steps(args.profile_steps)
        g.sync(args.device)
        prof_wall = (time.perf_counter() - t1) / args.profile_steps
    events = prof.events()
    gpu = [e for e in events if e.device_type.name == "CUDA"]
    busy = merged_busy_us([(e.time_range.start, e.time_range.end) for e in gpu]) / 1e3 / args.profile_steps
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                   "cuLaunchKernelEx")) / args.profile_steps
    reads = sum(1 for e in events if e.name == "aten::_local_scalar_dense") / args.profile_steps
    syncs = sum(1 for e in events if e.name in SYNC_CALLS) / args.profile_steps
    top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    config = BertConfig.preset(args.preset, vocab_size=30_522)
    flops = g.useful_flops(config, micro * accum, args.seq, max(20, args.seq * 20 // 128))
    w.engine = None  # free its memory before the next configuration
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {"zero": zero, "optimizer": optimizer, "micro": micro, "accum": accum, "seq_s": micro * accum / step_s,
            "step_ms": 1e3 * step_s, "prof_wall_ms": 1e3 * prof_wall, "gpu_busy_ms": busy, "launches": launches,
            "host_reads": reads, "syncs": syncs, "tflops": flops / step_s / 1e12, "warm_s": warm_s, "top": top}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="1:adamw:256:1,2:adamw:256:1,1:lamb:256:1",
                    help="zero:optimizer:micro:accum, comma-separated")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--preset", default="large")
    ap.add_argument("--warmup", type=int, default=4, help="optimizer steps before timing (the compile)")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps timed")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run of this script")
    ap.add_argument("--tables", action="store_true", help="print the profiler's top operators per configuration")
    args = ap.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA GPU: this benchmark needs one")
    import torch.distributed as dist

    from ports import free_port_block

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port_block(1)), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    card = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"\nBERT-{args.preset} seq {args.seq}, {card}, bf16, compile {'off' if args.no_compile else 'on'}, the "
          f"product's engine without Ray; torch.profiler over {args.profile_steps} steps; a row as each finishes")
    print("| ZeRO | optimizer | micro × accum | seq/s | useful TFLOP/s | step ms | GPU busy ms/step (profiled) "
          "| wall ms/step (profiled) | kernel launches/step | host reads/step | syncs/step | set-up + warm-up s |")
    print("|" + "---|" * 12, flush=True)
    for spec in args.configs.split(","):
        zero, opt, micro, accum = spec.split(":")
        try:
            r = profile_config(int(zero), opt, int(micro), int(accum), args)
        except Exception as exc:  # one configuration failing (memory) must not lose the others' figures
            print(f"config {spec}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        # printed at once: a run cut short by its time limit keeps the rows it finished
        print(f"| {r['zero']} | {r['optimizer']} | {r['micro']} × {r['accum']} | {r['seq_s']:,.0f} | "
              f"{r['tflops']:.0f} | {r['step_ms']:.1f} | {r['gpu_busy_ms']:.1f} | {r['prof_wall_ms']:.1f} | "
              f"{r['launches']:.0f} | {r['host_reads']:.1f} | {r['syncs']:.1f} | {r['warm_s']:.0f} |", flush=True)
        if args.tables:
            print(r["top"], flush=True)


if __name__ == "__main__":
    main()
