"""Load a checkpoint taken on another number of workers under ZeRO 1-3: its optimizer state re-partitioned.

ZeRO partitions the optimizer state by the data-parallel size: every rank's file holds flat slices of whole
parameter groups (ZeRO 1/2) or of every parameter (ZeRO 3), so another worker count cannot read them as they are.
DeepSpeed's universal checkpoint does the conversion: `ds_to_universal` gathers every parameter's full fp32 master
weights and optimizer moments (exp_avg, exp_avg_sq: AdamW's and our LAMB's) and step count into one folder per
parameter, and `load_checkpoint` with `checkpoint.load_universal` cuts them into the new partitions. Our LAMB needs
nothing more: its layouts (lamb_layout.py) describe the flat tensors of the new engine, which the load fills in
place. The learning-rate schedule, the step and the weights come from the checkpoint's model file as always.

One conversion per node (its local rank 0, into the node's temporary folder; the other ranks wait), read by every
rank, removed once loaded. On the tiny model it takes a fraction of a second; it reads and writes the optimizer
state once (16 bytes per parameter in fp32: ~5 GB for BERT-Large).

Two faults of DeepSpeed 0.19.8's ZeRO-3 universal load are mended after it (`_mend_zero3`): it gives every param
group the hyper-parameters of the first one (weight decay on the biases and LayerNorm weights), and it hands every
sub-group the same `step` tensor, which torch's AdamW then increments once per sub-group per step (a wrong bias
correction from the second step on). tests/test_repartition.py shows both mended: the loss curve continues.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import logging
import os
import shutil
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("bertpipe.pretrain")
UNIVERSAL_SUFFIX = "_universal"


def universal_folder(state_bytes: bytes) -> str:
    """Where a node converts a checkpoint: named by its position.json, the same bytes for every rank whichever
    folder it downloaded the checkpoint to."""
    key = hashlib.sha256(state_bytes).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"bertpipe-universal-{os.getuid()}-{key}")


def convert(checkpoint_dir: str, tag: str, out_root: str) -> str:
    """DeepSpeed's checkpoint `checkpoint_dir/tag` as a universal one, `out_root/<tag>_universal`, written whole
    or not at all (into a side folder first). Returns how long it took, in words, for the log."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    started = time.perf_counter()
    side = f"{out_root}.part-{os.getpid()}"
    shutil.rmtree(side, ignore_errors=True)
    os.makedirs(side)
    args = argparse.Namespace(input_folder=os.path.join(checkpoint_dir, tag),
                              output_folder=os.path.join(side, tag + UNIVERSAL_SUFFIX),
                              # In-process: no worker pools inside a training process (fork after threads).
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              # Our checkpoints carry no Megatron-style parallelism patterns: none are needed.
                              inject_missing_state=True)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):  # its prints and progress bars
            ds_to_universal(args)
    except BaseException:
        log.error("ds_to_universal failed on %s:\n%s", args.input_folder, said.getvalue()[-4000:])
        shutil.rmtree(side, ignore_errors=True)
        raise
    shutil.rmtree(out_root, ignore_errors=True)
    os.replace(side, out_root)
    return f"{time.perf_counter() - started:.1f} s"


def load_repartitioned(engine: Any, checkpoint_dir: str, tag: str, state_bytes: bytes, local_rank: int) -> None:
    """Load `checkpoint_dir/tag` (taken on another number of workers) into `engine`, every rank at once:
    weights, optimizer state re-partitioned, LR scheduler, step."""
    out_root = universal_folder(state_bytes)
    if local_rank == 0:
        took = convert(checkpoint_dir, tag, out_root)
        log.info("checkpoint %s converted to DeepSpeed's universal layout in %s", checkpoint_dir, took)
    dist.barrier()
    config = engine._config  # read by load_checkpoint only: set for this load, not for the next one (a retry)
    config.load_universal_checkpoint = True
    try:
        engine.load_checkpoint(out_root, tag=tag + UNIVERSAL_SUFFIX, load_optimizer_states=True,
                               load_lr_scheduler_states=True)
    finally:
        config.load_universal_checkpoint = False
    if engine.zero_optimization_stage() == 3:
        _mend_zero3(engine, os.path.join(out_root, tag + UNIVERSAL_SUFFIX))
    dist.barrier()
    if local_rank == 0:
        shutil.rmtree(out_root, ignore_errors=True)


def _mend_zero3(engine: Any, folder: str) -> None:
    """Each param group's own hyper-parameters (the checkpoint's), and a `step` tensor of its own per sub-group."""
    saved = torch.load(os.path.join(folder, "zero", "optimizer_state.pt"), map_location="cpu", weights_only=False)
    groups = saved.get("param_groups") or []
    optimizer = engine.optimizer.optimizer
    if len(groups) == len(optimizer.param_groups):
        for group, was in zip(optimizer.param_groups, groups):
            group.update({k: v for k, v in was.items() if k != "params"})
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def full_state(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's full fp32 master weights, optimizer moments and step count, by name, whatever the ZeRO
    stage: {name: {"fp32", "exp_avg", "exp_avg_sq", "step"}}. Collective under ZeRO (every rank calls it). Read from
    the optimizer's own tensors (DeepSpeed's safe_get_full_optimizer_state misses a ZeRO 1/2 param group whose state
    did not exist yet when it linked them)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    wrapper = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    if isinstance(wrapper, DeepSpeedZeroOptimizer):
        return _full_state_zero12(wrapper, names)
    if engine.zero_optimization_stage() == 3:
        return _full_state_zero3(engine, names)
    optimizer = wrapper if isinstance(wrapper, torch.optim.Optimizer) else wrapper.optimizer
    out = {}
    for p in engine.module.parameters():
        state = optimizer.state[p]
        out[names[id(p)]] = {"fp32": p.detach().float().clone(), "exp_avg": state["exp_avg"].clone(),
                             "exp_avg_sq": state["exp_avg_sq"].clone(), "step": _step(state)}
    return out


def _step(state: dict) -> torch.Tensor:
    return torch.as_tensor(state["step"], dtype=torch.float64).clone().reshape(())


def _full_state_zero12(wrapper: Any, names: dict[int, str]) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for i, group in enumerate(wrapper.bit16_groups):
        flat = wrapper.single_partition_of_fp32_groups[i]
        state = wrapper.optimizer.state[flat]
        sources = {"fp32": flat, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        for p in group:
            full = {k: torch.zeros(p.numel(), dtype=torch.float32, device=flat.device) for k in sources}
            mapping = p._hp_mapping
            if mapping is not None:  # this rank holds a fragment of p
                hp, lp = mapping.get_hp_fragment_address(), mapping.lp_fragment_address
                for key, source in sources.items():
                    full[key].narrow(0, lp.start, lp.numel).copy_(source.narrow(0, hp.start, hp.numel))
            for key in full:
                dist.all_reduce(full[key], group=wrapper.real_dp_process_group[i])
            out[names[id(p)]] = {**{k: v.view(p.shape).cpu() for k, v in full.items()}, "step": _step(state)}
    return out


def _full_state_zero3(engine: Any, names: dict[int, str]) -> dict[str, dict[str, torch.Tensor]]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    wrapper = engine.optimizer
    step_of = {}
    for i, group in enumerate(wrapper.fp16_groups):
        state = wrapper.optimizer.state[wrapper.fp32_partitioned_groups_flat[i]]
        for p in group:
            step_of[id(p)] = _step(state)
    out = {}
    for p in engine.module.parameters():
        out[names[id(p)]] = {"fp32": safe_get_full_fp32_param(p).cpu().clone(),
                             "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").cpu().clone(),
                             "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").cpu().clone(),
                             "step": step_of[id(p)]}
    return out
