"""Optimizers and the learning-rate schedule of pre-training, in plain torch (nothing to compile).

- AdamW: the paper's recipe (lr 1e-4, β 0.9/0.999, ε 1e-6, weight decay 0.01 except biases and LayerNorm).
  Unlike the original AdamWeightDecayOptimizer, torch's AdamW applies Adam's bias correction — this only
  changes the first few hundred steps, which warmup already tames.
- LAMB (You et al., 2019) as NVIDIA trains BERT with it: Adam moments with bias correction, decoupled weight
  decay added to the update, and the layer-wise trust ratio ‖w‖/‖update‖ applied only to parameters that
  get weight decay (apex FusedLAMB with use_nvlamb=False), one ratio per model parameter also when DeepSpeed
  hands the optimizer flat partitions (see Lamb). Global gradient clipping is DeepSpeed's.
- Schedule: linear warmup to the peak, then polynomial decay to zero (power 1 = the paper's linear decay,
  0.5 = NVIDIA's LAMB). LambdaLR multiplies the base lr, so the optimizers are built with lr 1.0 and
  `LrSchedule(step)` returns the absolute learning rate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bertpipe.jobs.pretrain.config import PretrainConfig
from bertpipe.model.training import param_groups, warmup_decay


@dataclass(frozen=True)
class FlatLayout:
    """Which parameters a flat tensor handed to Lamb holds: `segments` are (parameter index in the group, start,
    end) ranges of the flat tensor, `num_params` the group's parameter count (the same on every rank), and
    `process_group` the ranks the group's parameters are split over (None: this tensor holds whole parameters,
    nothing to sum across ranks). Elements in no segment (DeepSpeed's alignment padding) are left alone."""

    segments: tuple[tuple[int, int, int], ...]
    num_params: int
    process_group: Any = None


class Lamb(torch.optim.Optimizer):
    """LAMB with one trust ratio per model parameter, whatever tensors DeepSpeed hands it.

    Without a layout every tensor is one parameter (ZeRO 0: the model's tensors in fp32, one fp32 copy each in
    bf16/fp16). Under ZeRO 1/2 (any precision) and DeepSpeed's BF16_Optimizer the optimizer only sees flat fp32
    tensors (a rank's partition of a whole param group); `set_layout`
    (jobs/pretrain/engine/lamb_layout.py, after deepspeed.initialize) says which parameter segments each one holds. A
    step then sums every parameter's partial ‖w‖² and ‖update‖² over its segments, adds them up across the
    data-parallel group with one all-reduce per step (one vector for all parameters: ZeRO 1/2 call step once per
    param group and the no-decay group needs no ratio), and scales each segment by its parameter's own ratio.

    Gradient clipping and loss scaling stay DeepSpeed's and come before this step, as in NVIDIA's recipe (clip the
    global gradient norm, then LAMB): ZeRO 1/2 reduce the gradients, compute the global norm and call
    `unscale_and_clip_grads` (divides by loss scale × clip factor) before `_optimizer_step`; the bf16 optimizer
    calls `clip_tensors_by_global_norm` before `optimizer.step()`; the bf16/fp16 wrapper of ZeRO 0
    (FP16_UnfusedOptimizer) calls `unscale_and_clip_grads`, then `optimizer.step()`; plain fp32 ZeRO 0 runs
    `engine.clip_fp32_gradients()` in `_take_model_step` before `optimizer.step()` (DeepSpeed 0.19.8). An
    overflowing fp16 step is skipped by DeepSpeed before it reaches Lamb.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01):
        if lr <= 0 or eps <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr} betas={betas} eps={eps}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        # (flat tensor, its layout); matched by identity: torch's load_state_dict rebuilds the group dicts but
        # keeps the tensors, so a layout survives a checkpoint load. Not state: it depends on the world size.
        self._layouts: list[tuple[torch.Tensor, FlatLayout]] = []
        self._piece_cache: dict[tuple[int, Any], Pieces] = {}  # a layout as device index tensors, built once

    def set_layout(self, tensor: torch.Tensor, layout: FlatLayout) -> None:
        for j, start, end in layout.segments:
            if not (0 <= j < layout.num_params and 0 <= start < end <= tensor.numel()):
                raise ValueError(f"segment {(j, start, end)} outside a flat tensor of {tensor.numel()} elements "
                                 f"or a group of {layout.num_params} parameters")
        self._layouts = [(t, lay) for t, lay in self._layouts if t is not tensor] + [(tensor, layout)]

    def layout_of(self, tensor: torch.Tensor) -> FlatLayout | None:
        found = next((lay for t, lay in self._layouts if t is tensor), None)
        if found is None and self._layouts:
            # Layouts were set, so this tensor is flat too: one ratio for all of it would be silently wrong.
            raise RuntimeError(f"Lamb got a tensor of {tensor.numel()} elements with no layout; call "
                               "attach_lamb_layouts again after DeepSpeed replaced its flat partitions")
        return found

    def mapped_tensors(self) -> int:
        """How many of the tensors it steps have a layout (0 when they are the model's own parameters)."""
        return sum(any(t is p for t, _ in self._layouts) for g in self.param_groups for p in g["params"])

    def _adam_updates(self, group: dict, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Moments, bias correction and decoupled weight decay for all of a group's tensors at once (foreach
        kernels, no loop over tensors): the updates before the trust ratio."""
        beta1, beta2 = group["betas"]
        grads = [p.grad.float() for p in params]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
        ms = [self.state[p]["exp_avg"] for p in params]
        vs = [self.state[p]["exp_avg_sq"] for p in params]
        torch._foreach_mul_(ms, beta1)
        torch._foreach_add_(ms, grads, alpha=1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
        steps = [self.state[p]["step"] for p in params]
        m_hat = torch._foreach_div(ms, [1 - beta1 ** s for s in steps])
        denom = torch._foreach_sqrt(torch._foreach_div(vs, [1 - beta2 ** s for s in steps]))
        torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_div(m_hat, denom)
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, [p.float() for p in params], alpha=group["weight_decay"])
        return updates

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        pending = []  # split parameters: their ratios need the other ranks' partial norms
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            updates = self._adam_updates(group, params)
            lr = group["lr"]
            if group["weight_decay"] == 0:  # no decay, no trust ratio (NVIDIA: use_nvlamb=False)
                torch._foreach_add_(params, [(u * -lr).to(p.dtype) for p, u in zip(params, updates)])
                continue
            layouts = [self.layout_of(p) for p in params]
            whole = [(p, u) for p, u, lay in zip(params, updates, layouts) if lay is None]
            if whole:  # every tensor one parameter: one norm pair each, in two foreach calls
                ps, us = [p for p, _ in whole], [u for _, u in whole]
                w_norms = torch._foreach_norm([p.float() for p in ps])
                u_norms = torch._foreach_norm(us)
                ratios = _ratios(torch.stack([torch.stack(w_norms), torch.stack(u_norms)], 1).square())
                torch._foreach_mul_(us, list((ratios * -lr).unbind()))
                torch._foreach_add_(ps, [u.to(p.dtype) for p, u in zip(ps, us)])
            for p, update, layout in zip(params, updates, layouts):
                if layout is None:
                    continue
                if layout.process_group is None:
                    pieces = self._pieces(p, layout)
                    _apply(p, update, pieces, _ratios(_segment_sums(p, update, pieces)), lr)
                else:
                    pending.append((group, p, update, layout))
        if pending:
            self._step_split(pending)
        return loss

    def _pieces(self, p: torch.Tensor, layout: FlatLayout) -> "Pieces":
        """The layout as device index tensors, built on a tensor's first step and kept (the layout is fixed)."""
        key = (id(p), p.device)
        cached = self._piece_cache.get(key)
        if cached is None or cached.layout is not layout:
            cached = self._piece_cache[key] = Pieces.of(layout, p.numel(), p.device)
        return cached

    def _step_split(self, pending: list) -> None:
        """One all-reduce of every split parameter's partial squared norms, then each segment's own ratio."""
        groups = {id(lay.process_group): lay.process_group for *_, lay in pending}
        if len(groups) != 1:
            raise RuntimeError(f"Lamb step over {len(groups)} process groups; expected one data-parallel group")
        pieces = [self._pieces(p, lay) for _, p, _, lay in pending]
        sums = torch.cat([_segment_sums(p, update, pc) for (_, p, update, _), pc in zip(pending, pieces)])
        dist.all_reduce(sums, group=next(iter(groups.values())))
        ratios = _ratios(sums)
        offset = 0
        for (group, p, update, lay), pc in zip(pending, pieces):
            _apply(p, update, pc, ratios[offset: offset + lay.num_params], group["lr"])
            offset += lay.num_params


@dataclass(frozen=True)
class Pieces:
    """A flat tensor cut into consecutive pieces that cover it: every layout segment is a piece, and so is every gap
    between segments (DeepSpeed's alignment padding). `sizes` the piece lengths (and `lengths` the same on the
    device), `held` the pieces that are segments and `owner` the parameter each of those belongs to. A step then
    works on all segments at once: one split into views, foreach norms, one index_add — no loop of tensor ops."""

    layout: FlatLayout
    sizes: tuple[int, ...]
    held: tuple[int, ...]
    lengths: torch.Tensor
    held_index: torch.Tensor
    owner: torch.Tensor
    numel: int

    @classmethod
    def of(cls, layout: FlatLayout, numel: int, device) -> "Pieces":
        sizes, held, owner, at = [], [], [], 0
        for j, start, end in sorted(layout.segments, key=lambda seg: seg[1]):
            if start > at:
                sizes.append(start - at)
            held.append(len(sizes))
            owner.append(j)
            sizes.append(end - start)
            at = end
        if at < numel:
            sizes.append(numel - at)
        def on_device(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(layout, tuple(sizes), tuple(held), on_device(sizes), on_device(held), on_device(owner), numel)

    def segments_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat`, one per layout segment (in `owner` order)."""
        views = flat.split(self.sizes)
        return [views[i] for i in self.held]


def _segment_sums(p: torch.Tensor, update: torch.Tensor, pieces: Pieces) -> torch.Tensor:
    """[num_params, 2]: Σw² and Σupdate² of each parameter over the segments this tensor holds."""
    sums = torch.zeros(pieces.layout.num_params, 2, dtype=torch.float32, device=p.device)
    if not pieces.layout.segments:
        return sums
    norms = torch.stack([torch.stack(torch._foreach_norm(pieces.segments_of(p.float()))),
                         torch.stack(torch._foreach_norm(pieces.segments_of(update)))], 1)
    return sums.index_add_(0, pieces.owner, norms.square())


def _ratios(sums: torch.Tensor) -> torch.Tensor:
    """‖w‖/‖update‖ per row of [n, 2] squared norms; 1 where either norm is zero (NVIDIA's rule)."""
    w_norm, u_norm = sums[:, 0].sqrt(), sums[:, 1].sqrt()
    return torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))


def _apply(p: torch.Tensor, update: torch.Tensor, pieces: Pieces, ratios: torch.Tensor, lr: float) -> None:
    """p += -lr × ratio(owner) × update on every segment; the gaps between segments are left alone."""
    if not pieces.layout.segments:
        return
    factors = ratios.index_select(0, pieces.owner) * -lr  # one per segment
    # CUDA: one scale tensor and two kernels (foreach with one scalar tensor per view has no CUDA fast path);
    # CPU: repeat_interleave over a whole partition is ~10× slower than scaling the views in place.
    (_apply_scale_tensor if p.is_cuda else _apply_views)(p, update, pieces, factors)


def _apply_scale_tensor(p: torch.Tensor, update: torch.Tensor, pieces: Pieces, factors: torch.Tensor) -> None:
    per_piece = torch.zeros(len(pieces.sizes), dtype=torch.float32, device=p.device)
    per_piece.index_copy_(0, pieces.held_index, factors)
    p.add_((update * torch.repeat_interleave(per_piece, pieces.lengths, output_size=pieces.numel)).to(p.dtype))


def _apply_views(p: torch.Tensor, update: torch.Tensor, pieces: Pieces, factors: torch.Tensor) -> None:
    segments = pieces.segments_of(update)
    torch._foreach_mul_(segments, list(factors.unbind()))
    torch._foreach_add_(pieces.segments_of(p), [u.to(p.dtype) for u in segments])


def make_optimizer(cfg: PretrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "lamb":
        return Lamb(groups, lr=1.0, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    fused = cfg.use_gpu and torch.cuda.is_available()
    return torch.optim.AdamW(groups, lr=1.0, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             fused=fused or None)


class LrSchedule:
    """step (0-based optimizer step) → absolute learning rate. A callable object (not a lambda) so that
    LambdaLR's state_dict round-trips it in checkpoints."""

    def __init__(self, cfg: PretrainConfig):
        steps = cfg.phase_steps()
        if cfg.lr_schedule == "run":
            first = cfg.phases[0]
            self.segments = [(0, cfg.max_steps, first.learning_rate, first.warmup_steps)]
        else:
            starts = [sum(steps[:i]) for i in range(len(steps))]
            self.segments = [(s, n, ph.learning_rate, ph.warmup_steps)
                             for s, n, ph in zip(starts, steps, cfg.phases)]
        self.power = cfg.decay_power

    def __call__(self, step: int) -> float:
        start, num, peak, warmup = self.segments[0]
        for seg in self.segments:
            if step >= seg[0]:
                start, num, peak, warmup = seg
        return peak * warmup_decay(step - start, num, warmup, self.power)


def make_scheduler(cfg: PretrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, LrSchedule(cfg))
