"""Checkpoints taken on 2 workers resumed on 1 and the other way round, under ZeRO 1, 2, 3 with AdamW and ZeRO 1, 2
with LAMB (LAMB under ZeRO 3 is refused by PretrainConfig): the product's engine (engine.build_engine), its checkpoint
files (folders.save_dir) and its load (folders.load_dir: re-partitioned through repartition.py), in
torch.multiprocessing ranks over gloo, without Ray.

Every layout trains the same global batches, cut into the same micro-batches of MICRO rows: 2 workers take half of
each step's micro-batches (accumulation 2), 1 worker takes all of them (accumulation 4), so an uninterrupted run
computes the same mean gradient on either layout and only the order of float reductions differs. No dropout.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

CONFIGS = [(1, "adamw"), (2, "adamw"), (3, "adamw"), (1, "lamb"), (2, "lamb")]
GLOBAL, MICRO, SEQ, PREDS = 16, 4, 32, 5
BEFORE, AFTER = 3, 4  # optimizer steps before the checkpoint, and after it
WAIT_S = 600  # a hang guard: how long a layout waits for the other one's checkpoints (seconds on 2 loaded cores)


def key(zero: int, optimizer: str) -> str:
    return f"zero{zero}_{optimizer}"


def config(zero: int, optimizer: str, workers: int):
    from bertpipe.jobs.pretrain.config import PhaseConfig

    from pretrain_helpers import tiny_config

    return tiny_config(num_workers=workers, zero_stage=zero, optimizer=optimizer, max_steps=BEFORE + AFTER,
                       phases=(PhaseConfig(max_seq_length=SEQ, max_predictions_per_seq=PREDS, global_batch_size=GLOBAL,
                                           micro_batch_size=MICRO, learning_rate=3e-3, warmup_steps=2),))


def layout(zero: int, workers: int) -> dict:
    from bertpipe.jobs.pretrain.runs import layout_of

    return layout_of(workers, [MICRO], zero)


def global_batches() -> list[dict[str, torch.Tensor]]:
    """BEFORE + AFTER global batches of GLOBAL rows, masked once (the same masks on every layout)."""
    from bertpipe.jobs.pretrain.data.masking import MaskingSpec, batch_rng, mask_batch

    import pretrain_helpers as h
    from engine_helpers import raw_batches

    spec = MaskingSpec.from_vocab(h.TOKENS, max_seq_length=SEQ, max_predictions=PREDS)
    return [mask_batch(raw, spec, batch_rng(7, 0, 0, 0, i)) for i, raw in enumerate(raw_batches(BEFORE + AFTER, GLOBAL,
                                                                                              SEQ))]


def step(engine, batch: dict[str, torch.Tensor], rank: int, world: int) -> float:
    """One optimizer step on this rank's micro-batches of a global batch; the step's mean micro-batch loss over
    all ranks (what the loss curve plots)."""
    import torch.distributed as dist

    share = GLOBAL // world
    total = torch.zeros(1)
    for m in range(share // MICRO):
        start = rank * share + m * MICRO
        b = {k: v[start:start + MICRO] for k, v in batch.items()}
        out = engine(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["masked_positions"],
                     b["masked_lm_labels"], b["next_sentence_label"])
        engine.backward(out.loss)
        engine.step()
        total += out.loss.detach().float()
    dist.all_reduce(total)
    return float(total) / (GLOBAL // MICRO)


def build(zero: int, optimizer: str, world: int):
    from bertpipe.jobs.pretrain.engine.build import build_engine
    from bertpipe.jobs.pretrain.config import ModelConfig

    import pretrain_helpers as h

    model = ModelConfig(preset="tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    engine, _ = build_engine(config(zero, optimizer, world), model, len(h.TOKENS), 7, world)
    return engine


def worker(rank: int, world: int, port: int, root: str) -> None:
    """On `world` ranks: "train" (an uninterrupted run: its state at the checkpoint it saves after BEFORE steps, and
    its losses after), then "resume" (from the other layout's checkpoints, once they are all there: the state loaded,
    the losses after). Rank 0 writes {config: {"state", "losses", "position", "global_steps"}} to
    root/<mode>-w<world>.pt, and root/trained-w<world> once its checkpoints are saved."""
    import torch.distributed as dist

    from bertpipe.jobs.pretrain.checkpointing import folders, repartition
    from bertpipe.jobs.pretrain.checkpointing.resume import Position

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    batches = global_batches()
    for mode in ("train", "resume"):
        if mode == "resume":
            _wait_for(Path(root) / f"trained-w{3 - world}")
        results = {}
        for zero, optimizer in CONFIGS:
            engine = build(zero, optimizer, world)
            folder = Path(root) / key(zero, optimizer)
            if mode == "train":
                for batch in batches[:BEFORE]:
                    step(engine, batch, rank, world)
                state = repartition.full_state(engine)
                position = Position(BEFORE, 0, 0, BEFORE * GLOBAL // world // MICRO, BEFORE * GLOBAL // world, MICRO)
                target = folder / f"w{world}"
                target.mkdir(parents=True, exist_ok=True)
                folders.save_dir(engine, str(target), {**position.__dict__, "history": [],
                                                           "layout": layout(zero, world)})
                found = {}
            else:
                found = folders.load_dir(engine, str(folder / f"w{3 - world}"), layout(zero, world), rank)
                state = repartition.full_state(engine)
            groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.optimizer.param_groups]
            losses = [step(engine, batch, rank, world) for batch in batches[BEFORE:]]
            results[key(zero, optimizer)] = {"state": state, "groups": groups, "losses": losses, "position": found,
                                             "global_steps": engine.global_steps}
            dist.barrier()
            del engine
        if rank == 0:
            torch.save(results, str(Path(root) / f"{mode}-w{world}.pt"))
            if mode == "train":
                (Path(root) / f"trained-w{world}").touch()
        dist.barrier()
    dist.destroy_process_group()


def _wait_for(marker: Path) -> None:
    give_up = time.monotonic() + WAIT_S
    while not marker.exists():
        if time.monotonic() > give_up:
            raise RuntimeError(f"hung: no {marker.name} after {WAIT_S} s")
        time.sleep(0.2)


def run_all(root: Path) -> dict:
    """2 workers and 1 worker at once: each trains and saves, then resumes the other's checkpoints.
    {(mode, world): results}."""
    import torch.multiprocessing as mp

    from ports import free_port_block

    base = free_port_block(2)  # one block: the draw is seeded by the process id, two calls return one port
    running = [mp.start_processes(worker, args=(world, base + world - 1, str(root)), nprocs=world, join=False,
                                  start_method="spawn") for world in (2, 1)]
    for context in running:
        while not context.join():  # raises when a rank failed (its traceback in the message)
            pass
    return {(mode, world): torch.load(str(root / f"{mode}-w{world}.pt"), weights_only=False)
            for mode, world in (("train", 2), ("train", 1), ("resume", 1), ("resume", 2))}
