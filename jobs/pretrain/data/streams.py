"""A pre-training worker's data: its share of each epoch's training rows (Ray Train's dataset shard, streamed, order
preserved so the split is deterministic), shuffled and length-binned by seeds of (epoch, rank), and its held-out
rows, read once. Before the first step every stream the run opens at a known time is opened at once."""
from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from bertpipe.jobs.pretrain.checkpointing import resume
from bertpipe.jobs.pretrain.checkpointing.resume import Position
from bertpipe.jobs.pretrain.config import PhaseConfig
from bertpipe.jobs.pretrain.data.heldout import read_heldout
from bertpipe.jobs.pretrain.data import shared_order
from bertpipe.jobs.pretrain.data.length_binning import length_binned
from bertpipe.jobs.pretrain.data.masking import seed_of
from bertpipe.jobs.pretrain.metrics.eta import EVAL_BATCH
from bertpipe.jobs.pretrain.worker_spec import WorkerSpec

if TYPE_CHECKING:
    from bertpipe.jobs.pretrain.metrics.training_metrics import TrainingMetrics

log = logging.getLogger("bertpipe.pretrain")


class WorkerData:
    def __init__(self, spec: WorkerSpec, rank: int, world: int, metrics: TrainingMetrics):
        self.spec, self.rank, self.world, self.metrics = spec, rank, world, metrics
        self.heldout: dict[int, list] = {}  # seq length -> this worker's held-out batches
        self.opened: dict[tuple[int, int], tuple] = {}  # (phase, epoch) -> (first batch, the rest), opened ahead

    def epoch_batches(self, phase_index: int, epoch: int, micro: int | None = None):
        """This worker's micro-batches of one epoch of a phase, shuffled and length-binned with seeds of (epoch,
        rank): of the phase's micro_batch_size, or of `micro` rows (an epoch dealt in another size before a
        resume)."""
        import ray.train

        cfg, phase, seed = self.spec.pretrain, self.spec.pretrain.phases[phase_index], self.spec.seed
        batches = ray.train.get_dataset_shard(f"train_{phase.max_seq_length}").iter_batches(
            batch_size=micro or phase.micro_batch_size, batch_format="numpy", drop_last=True,
            prefetch_batches=cfg.prefetch_batches, local_shuffle_buffer_size=cfg.shuffle_buffer_rows or None,
            local_shuffle_seed=seed_of(seed, phase_index, epoch, self.rank))
        return length_binned(batches, cfg.length_bin_window,
                             np.random.default_rng(seed_of(seed, phase_index, epoch, self.rank, 2)))

    def micro_batches(self, position: Position, batches=None) -> Iterator[tuple[int, dict, float]]:
        """(index in the epoch, shard rows, when pulling them began) of each micro-batch of the epoch in progress at
        `position` still to train. The epoch's share is read in micro-batches of the size it was dealt in
        (`position.dealt`); where that is the phase's size now, the micro-batches trained before the checkpoint a
        resumed worker starts from are dropped without collating; otherwise (a resume with another micro-batch) the
        sequences not trained yet are re-cut into the new size (resume.recut). `batches`: the rows in micro-batches
        (default this worker's share of the phase's dataset, opened ahead by open_all where it could be)."""
        if self.spec.pretrain.elastic and batches is None:
            yield from self.shared_micro_batches(position)
            return
        phase_index, epoch = position.phase, position.epoch
        micro = self.spec.pretrain.phases[phase_index].micro_batch_size
        dealt = position.dealt or micro
        ahead = self.opened.pop((phase_index, epoch), None) if batches is None else None
        if ahead is not None:
            it = itertools.chain([ahead[0]] if ahead[0] is not None else [], ahead[1])
        else:
            it = iter(batches) if batches is not None else self.epoch_batches(phase_index, epoch, dealt)
        if resume.skips_whole_batches(position, dealt, micro):
            skip, first = position.sequences // micro, 0
        else:
            log.info("the epoch in progress goes on re-cut: %d sequences trained, micro-batches of %d from here",
                     position.sequences, micro)
            skip, first, it = 0, position.batch, resume.recut(it, position.sequences, micro)
        length = self.spec.pretrain.phases[phase_index].max_seq_length
        for n in itertools.count():
            pulled_at = time.perf_counter()
            raw = next(it, None)
            if n == 0 and ahead is None:  # the first batch of a new data stream: Ray Data starts an execution
                opened = time.perf_counter() - pulled_at
                self.metrics.stream_opened(opened, before_training=False)
                log.info("rank %d: seq %d data stream opened in %.1f s", self.rank, length, opened)
            if raw is None:
                if n == 0 and not position.sequences:  # (a re-cut epoch resumed at its end has no batch left)
                    raise ValueError(f"worker {self.rank} got no batch at seq {length}: too few training rows for "
                                     "num_workers × micro_batch_size")
                return
            if n >= skip:
                yield first + n, raw, pulled_at

    def shared_micro_batches(self, position: Position) -> Iterator[tuple[int, dict, float]]:
        """An elastic run's micro_batches: this rank's share of the epoch's shared order (shared_order.py) from the
        global count of sequences trained, `position.sequences`, whatever worker count trained them."""
        phase = self.spec.pretrain.phases[position.phase]
        first = position.sequences // phase.global_batch_size
        batches = shared_order.global_batches(self.spec.train_shards[phase.max_seq_length], self.spec.seed,
                                              position.phase, position.epoch, phase.global_batch_size, skip=first)
        it = shared_order.rank_micro_batches(batches, first, self.rank, self.world, phase.micro_batch_size)
        while True:
            pulled_at = time.perf_counter()
            got = next(it, None)
            if got is None:
                return
            yield got[0], got[1], pulled_at

    def heldout_batches(self, phase: PhaseConfig) -> list[dict[str, np.ndarray]]:
        """This worker's held-out rows at the phase's length (at most eval_max_batches batches of EVAL_BATCH,
        heldout.py), read once: every evaluation reuses them."""
        length = phase.max_seq_length
        if length not in self.heldout:
            started = time.perf_counter()
            self.heldout[length] = read_heldout(self.spec.heldout[length], self.rank, self.world,
                                                self.spec.rows[f"heldout_{length}"],
                                                self.spec.pretrain.eval_max_batches, EVAL_BATCH)
            log.info("rank %d: %d held-out batches at seq %d read in %.1f s", self.rank, len(self.heldout[length]),
                     length, time.perf_counter() - started)
        return self.heldout[length]

    def open_all(self, position: Position, doing: Callable[[str], None]) -> None:
        """Before the first step, every data stream the run opens at a known time, opened at once (in threads: Ray
        Data starts an execution for each, seconds each on a small machine, mostly waiting on processes): the first
        training epoch of every phase still to train, its first micro-batches pulled (micro_batches goes on from
        there), and meanwhile each phase's held-out rows are read (heldout_batches). No phase switch and no
        evaluation waits for data mid-training, and what is left after any step is predictable (eta.py). `doing`
        tells the driver's progress line."""
        cfg = self.spec.pretrain
        ends = np.cumsum(cfg.phase_steps())
        streams, heldout = {}, []
        for q, (phase, steps) in enumerate(zip(cfg.phases, cfg.phase_steps())):
            if not steps:
                continue
            heldout.append(phase)
            if ends[q] > position.step and q >= position.phase and not cfg.elastic:  # (shared order: no stream)
                epoch, dealt = (position.epoch, position.dealt) if q == position.phase else (0, 0)
                streams[f"seq {phase.max_seq_length}"] = (self._open_epoch, q, epoch, dealt or phase.micro_batch_size)
        doing(f"opening the training data streams ({', '.join(streams)})" if streams else "reading held-out data")
        with ThreadPoolExecutor(max_workers=max(len(streams), 1), thread_name_prefix="open-stream") as pool:
            futures = [pool.submit(*job) for job in streams.values()]
            for phase in heldout:
                self.heldout_batches(phase)
            for future in futures:
                future.result()

    def _open_epoch(self, phase_index: int, epoch: int, micro: int) -> None:
        started = time.perf_counter()
        it = iter(self.epoch_batches(phase_index, epoch, micro))
        self.opened[(phase_index, epoch)] = (next(it, None), it)
        opened = time.perf_counter() - started
        self.metrics.stream_opened(opened, before_training=True)
        log.info("rank %d: training stream phase %d epoch %d opened in %.1f s", self.rank, phase_index, epoch, opened)
