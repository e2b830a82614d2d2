"""Tell our Lamb which model parameters sit where in the flat tensors DeepSpeed hands it.

Under ZeRO 1/2 (DeepSpeedZeroOptimizer) and the bf16 optimizer (BF16_Optimizer: bf16 at ZeRO 1 with fp32
gradient accumulation) DeepSpeed replaces each param group of a client optimizer by one flat fp32 tensor, this
rank's partition of the group. Both record, for each model parameter, the fragment of it that partition holds
(`param._hp_mapping`, from `link_hp_params`: the map universal checkpoints use, which accounts for the alignment
padding between parameters). At ZeRO 0, fp32 hands Lamb the model's parameters and bf16/fp16 with a non-fused
optimizer (FP16_UnfusedOptimizer) one fp32 copy per parameter: nothing to map. ZeRO 3 is refused by `PretrainConfig`
(it steps flat sub-groups one at a time), and any other wrapper here, so a ratio is never silently flat.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from bertpipe.jobs.pretrain.engine.optim import FlatLayout, Lamb


def _fragment_segments(params: list[torch.Tensor]) -> tuple[tuple[int, int, int], ...]:
    """(index, start, end) in the partition of every parameter with a fragment on this rank."""
    segments = []
    for j, p in enumerate(params):
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is not None:
            address = mapping.get_hp_fragment_address()
            segments.append((j, int(address.start), int(address.start + address.numel)))
    return tuple(segments)


def _check_coverage(params: list[torch.Tensor], layout: FlatLayout) -> None:
    """Every element of every parameter is held by exactly one rank: catches a changed DeepSpeed mapping before
    it skews a single ratio (one all-reduce per group, at start-up only)."""
    # On the parameters' device: NCCL reduces only GPU tensors (gloo reduces CPU ones).
    device = params[0].device if params else torch.device("cpu")
    held = torch.zeros(len(params), dtype=torch.float64)
    for j, start, end in layout.segments:
        held[j] += end - start
    held = held.to(device)
    if layout.process_group is not None:
        dist.all_reduce(held, group=layout.process_group)
    held = held.cpu()
    want = torch.tensor([p.numel() for p in params], dtype=torch.float64)
    if not torch.equal(held, want):
        bad = int((held != want).nonzero()[0])
        raise RuntimeError(f"LAMB layout covers {int(held[bad])} of the {int(want[bad])} elements of parameter "
                           f"{bad} of its group: DeepSpeed's partition map is not what lamb_layout expects")


def _partitioned(wrapper: Any, lp_groups: list, flats: list) -> list[tuple[torch.Tensor, FlatLayout, list]]:
    return [(flat, FlatLayout(_fragment_segments(params), len(params), wrapper.real_dp_process_group[i]), params)
            for i, (params, flat) in enumerate(zip(lp_groups, flats))]


def layouts_of(wrapper: Any) -> list[tuple[torch.Tensor, FlatLayout, list]]:
    """(flat tensor, layout, the group's model parameters) per param group of DeepSpeed's optimizer wrapper."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(wrapper, DeepSpeedZeroOptimizer):
        if wrapper.cpu_offload:
            raise ValueError("LAMB with ZeRO optimizer offload is not supported (PretrainConfig refuses it)")
        return _partitioned(wrapper, wrapper.bit16_groups, wrapper.single_partition_of_fp32_groups)
    if isinstance(wrapper, BF16_Optimizer):
        return _partitioned(wrapper, wrapper.bf16_groups, wrapper.fp32_groups_flat_partition)
    if isinstance(wrapper, FP16_UnfusedOptimizer):
        return []  # one fp32 copy per parameter: Lamb sees whole parameters
    raise ValueError(f"LAMB cannot be made layer-wise under DeepSpeed's {type(wrapper).__name__}; "
                     "use zero_stage 0, 1 or 2")


def attach_lamb_layouts(engine: Any) -> int:
    """After deepspeed.initialize: give the engine's Lamb the layout of each flat tensor it steps. Returns how
    many it set (0 when DeepSpeed hands Lamb the model's own parameters: ZeRO 0 in fp32)."""
    wrapper = engine.optimizer
    if isinstance(wrapper, Lamb):
        return 0
    lamb = wrapper.optimizer
    if not isinstance(lamb, Lamb):
        raise TypeError(f"expected our Lamb inside {type(wrapper).__name__}, got {type(lamb).__name__}")
    found = layouts_of(wrapper)
    for flat, layout, params in found:
        _check_coverage(params, layout)
        lamb.set_layout(flat, layout)
    return len(found)


def mapped_layouts(engine: Any) -> int:
    """How many flat tensors the engine's Lamb steps with a layout now (after a checkpoint load too)."""
    lamb = engine.optimizer if isinstance(engine.optimizer, Lamb) else engine.optimizer.optimizer
    return lamb.mapped_tensors()
