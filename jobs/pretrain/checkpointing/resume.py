"""Where a resumed pre-training run goes on when its layout changed (another worker count, another micro-batch:
runs.py keeps such a run's name), and what carries over.

Carried over exactly, whatever the layout: the weights, the optimizer state (fp32 master weights, moments and step
counts of every parameter: re-partitioned through DeepSpeed's universal checkpoint when the worker count changed
under ZeRO 1-3, repartition.py), the learning-rate schedule's position and the step. The global batch stays as
configured; gradient accumulation adapts (global batch = micro-batch × workers × accumulation steps).

The data position. Ray Data deals every worker its share of an epoch (the split depends on the worker count), and
the worker shuffles and length-bins its share in windows of micro-batches (the order depends on the micro-batch
size too). A checkpoint records, for each phase's epoch in progress, how many sequences of its share a worker
trained (`Position.sequences`, the same on every worker) and the micro-batch size the share is read in
(`Position.dealt`). The rule, on resuming:

- The same worker count and micro-batch: every worker skips the micro-batches it trained and goes on as the
  uninterrupted run would (the same batches, masks and dropout draws).
- The same worker count, another micro-batch: every worker reads its share of the epoch as it was dealt (in
  micro-batches of the size it was read in), drops the sequences it trained and cuts the rest into micro-batches of
  the new size. The rest of the epoch is exactly the sequences not trained yet, in their order: none twice, none
  left out beyond an epoch's usual tail (its last rows short of a micro-batch). Their masks and dropout draws
  differ (both are drawn per micro-batch). The next epoch is read in the new size.
- Another worker count: the new workers are dealt the epoch's rows anew, so which rows of their shares were trained
  cannot be told. The rest of the epoch in progress is left out (the resume line says how many sequences) and
  training goes on with the next epoch: no sequence of the epoch in progress is trained twice. A checkpoint taken
  at the start of an epoch leaves nothing out.
- An elastic run (num_workers a range) reads every epoch in one order shared by all workers (data/shared_order.py),
  and its `Position.sequences` counts every worker's sequences in it (`Position.shared` = 1): on any worker count it
  goes on at the next global batch, none lost, none twice. Between a shared order and a fixed count's shares (the
  range made a count, or the other way) the epoch in progress ends as with another worker count.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from bertpipe.jobs.pretrain.config import PretrainConfig
from bertpipe.jobs.pretrain.data.length_binning import as_rows, concat_rows


@dataclass
class Position:
    """Where in the data a worker is: optimizer step, phase, epoch of the phase, and within that epoch the
    micro-batches it trained (`batch`: seeds its masks and dropout), the sequences of its share it trained
    (`sequences`) and the micro-batch size its share is read in (`dealt`; 0 = not started: the phase's size);
    `shared` = 1: the epoch is read in an elastic run's shared order and `sequences` counts every worker's."""

    step: int = 0
    phase: int = 0
    epoch: int = 0
    batch: int = 0
    sequences: int = 0
    dealt: int = 0
    shared: int = 0


@dataclass(frozen=True)
class ResumePlan:
    """How a checkpoint taken with layout `then` goes on with layout `now` (resume_plan)."""

    position: Position  # where the workers go on
    repartition: bool  # the optimizer state is re-partitioned (another worker count under ZeRO 1-3)
    left_out: int  # sequences of the epoch in progress not trained (another worker count, mid-epoch)
    recut: int  # > 0: the rest of the epoch in progress is re-cut into micro-batches of this size
    carries: str  # what carries over, in words: the tail of the resume line


def position_of(state: dict[str, Any], then: dict[str, Any]) -> Position:
    """The Position in a checkpoint's position.json, taken with layout `then`. Those written before `sequences`
    and `dealt` existed count micro-batches only, of the size `then` trained with."""
    known = {f.name for f in dataclasses.fields(Position)}
    position = Position(**{k: int(v) for k, v in state.items() if k in known})
    if "sequences" not in state and position.batch:
        micro = then["micro_batch_sizes"][position.phase]
        position = dataclasses.replace(position, sequences=position.batch * micro, dealt=micro)
    return position


def skips_whole_batches(position: Position, dealt: int, micro: int) -> bool:
    """The epoch in progress goes on by skipping the micro-batches trained (it is read in the size it was dealt in,
    `dealt`, which is the size now, `micro`); otherwise its rest is re-cut (recut)."""
    return dealt == micro and position.sequences % micro == 0


def repartition_needed(then: dict[str, Any] | None, now: dict[str, Any]) -> bool:
    """ZeRO 1-3 partition the optimizer state by worker count: another one needs it re-partitioned."""
    return bool(then) and then["num_workers"] != now["num_workers"] and now["zero_stage"] >= 1


def resume_plan(position: Position, then: dict[str, Any] | None, now: dict[str, Any], cfg: PretrainConfig,
                rows: dict[str, int]) -> ResumePlan:
    """Where the workers go on from `position` (of a checkpoint taken with layout `then`, None = this one) with
    layout `now`; `rows` the training rows of each phase ({"train_128": n, ...}: the size of an epoch)."""
    then = then or now
    steps = cfg.phase_steps()
    in_epoch = position.step < sum(steps[: position.phase + 1]) and position.sequences > 0
    phase = cfg.phases[position.phase] if position.phase < len(cfg.phases) else None
    repartition = repartition_needed(then, now)
    state = (f"optimizer state (re-partitioned from {_workers(then['num_workers'])} to {now['num_workers']})"
             if repartition else "optimizer state")
    exact = f"weights, {state}, LR schedule position and step {position.step}"
    if not in_epoch or phase is None:
        return ResumePlan(position, repartition, 0, 0, f"{exact} carry over exactly; the data position is an "
                                                       "epoch's start, the same in any layout")
    micro, dealt = now["micro_batch_sizes"][position.phase], position.dealt or then["micro_batch_sizes"][
        position.phase]
    where = f"the seq-{phase.max_seq_length} epoch in progress"
    if position.shared and now.get("elastic"):
        return ResumePlan(position, repartition, 0, 0, (
            f"{exact} carry over exactly, and so does the data position: {where} goes on at its sequence "
            f"{position.sequences:,} in the order every worker count shares"))
    if bool(position.shared) != bool(now.get("elastic")):
        return _epoch_ends(position, repartition, exact, where, rows.get(f"train_{phase.max_seq_length}", 0)
                           // phase.global_batch_size * phase.global_batch_size - position.sequences
                           if position.shared else _share_left(position, then, rows, phase, dealt))
    if then["num_workers"] != now["num_workers"]:
        return _epoch_ends(position, repartition, exact, where, _share_left(position, then, rows, phase, dealt))
    if skips_whole_batches(position, dealt, micro):
        return ResumePlan(position, repartition, 0, 0, f"{exact} carry over exactly, and so does the data position")
    return ResumePlan(position, repartition, 0, micro, (
        f"{exact} carry over exactly, and so does the data position: the rest of {where} is the sequences not "
        f"trained yet, in their order, re-cut from micro-batches of {dealt} into {micro} (their masks and dropout "
        "draws differ)"))


def _share_left(position: Position, then: dict[str, Any], rows: dict[str, int], phase, dealt: int) -> int:
    """Sequences of the epoch in progress no worker of a fixed count `then` trained yet."""
    share = rows.get(f"train_{phase.max_seq_length}", 0) // then["num_workers"]
    return then["num_workers"] * max(share // dealt * dealt - position.sequences, 0)


def _epoch_ends(position: Position, repartition: bool, exact: str, where: str, left: int) -> ResumePlan:
    """The plan of a resume that cannot tell which rows of the epoch in progress were trained: its rest (`left`
    sequences) is left out and training goes on with the next epoch."""
    left = max(left, 0)
    after = Position(position.step, position.phase, position.epoch + 1)
    return ResumePlan(after, repartition, left, 0, (
        f"{exact} carry over exactly; the data does not: another worker count deals an epoch's rows anew, so "
        f"the rest of {where} ({left:,} sequences not trained yet) is left out and training goes on with the "
        "next epoch (no sequence of this one trained twice)"))


def _workers(n: int) -> str:
    return f"{n} worker{'s' if n != 1 else ''}"


def recut(batches: Iterable[dict[str, Any]], skip: int, micro: int) -> Iterator[dict[str, Any]]:
    """The rows of `batches` after the first `skip`, in their order, in micro-batches of `micro` rows; the last
    rows short of a micro-batch are left out (as an epoch's last rows are: drop_last)."""
    pending: list[dict[str, Any]] = []
    held = 0
    for batch in batches:
        n = len(next(iter(batch.values())))
        if skip >= n:
            skip -= n
            continue
        if skip:
            batch = {k: as_rows(v)[skip:] for k, v in batch.items()}
            n -= skip
            skip = 0
        pending.append(batch)
        held += n
        while held >= micro:
            merged = concat_rows(pending)
            yield {k: v[:micro] for k, v in merged.items()}
            rest = {k: v[micro:] for k, v in merged.items()}
            held -= micro
            pending = [rest] if held else []

