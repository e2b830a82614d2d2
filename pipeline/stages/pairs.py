"""The `pairs` stage: clean documents -> sentences -> WordPiece ids -> NSP instances -> equal-row Parquet shards.

Two passes of Ray tasks, streaming; every task holds at most `pairs.max_task_bytes` whatever the corpus size and
the shard count, and asks Ray for that much `memory`, so a node runs only as many tasks at once as its memory holds:
1. pair_pools.py: one task per pool of documents tokenizes (encoding.py), pairs and writes the pool's instances as
   part files (part_files.py); a row of counters per pool comes back;
2. shard_cells.py: per length, cells of equal shares of every part, each shuffled and streamed into shards of exactly
   the same row count; the held-out parts into one shard. Then the part files are deleted.
A task Ray kills for memory anyway is one console line with what to set (framework/memory_kills.py).
"""
from __future__ import annotations

import functools
import logging
import time

import pyarrow as pa
import pyarrow.parquet as pq

from bertpipe.pipeline.formats import shards
from bertpipe.pipeline.framework import memory_kills, storage
from bertpipe.pipeline.framework.stage import StageContext, StageInputError, StageResult
from bertpipe.pipeline.formats.vocabulary import load_vocab, special_ids, vocab_file, vocab_hash
from bertpipe.pipeline.stages.config import PairsConfig, VocabConfig
from bertpipe.pipeline.stages.documents import document_files
from bertpipe.pipeline.stages.instances import derive_seed
from bertpipe.pipeline.stages.pair_pools import PASS1_CLOCKS, COUNTERS, pair_docs, plan_pools, pool_text_limit
from bertpipe.pipeline.stages.shard_cells import cell_rows, concat_parts, plan_shards, row_group_rows, write_cells

log = logging.getLogger(__name__)

PASS_PARTS_DIR = "_parts"  # pass 1's part files, under the stage's output until pass 2 has read them


SAMPLE_INSTANCES = 5  # instances the stage shows decoded (google-research/bert's create_pretraining_data logs 20)
SAMPLE_FILE = "instances.txt"


def describe_instances(table: pa.Table, tokens: list[str]) -> str:
    """Instances decoded to text as create_pretraining_data.py logs them (tokens, segment_ids, is_random_next),
    plus segments A and B with the WordPiece pieces joined back into words."""
    blocks = []
    for ids, b_start, label in zip(table.column("input_ids").to_pylist(), table.column("segment_b_start").to_pylist(),
                                   table.column("next_sentence_label").to_pylist()):
        pieces = [tokens[i] for i in ids]
        blocks.append("\n".join([
            "*** Example ***",
            "tokens: " + " ".join(pieces),
            "segment_ids: " + " ".join("0" if k < b_start else "1" for k in range(len(ids))),
            f"is_random_next: {bool(label)}",
            "A: " + " ".join(pieces[1:b_start - 1]).replace(" ##", ""),
            "B: " + " ".join(pieces[b_start:-1]).replace(" ##", ""),
        ]))
    return "\n\n".join(blocks) + "\n"


def show_instances(ctx: StageContext, shard_uri: str, tokens: list[str]) -> str:
    """The first SAMPLE_INSTANCES rows of a training shard (the shards are shuffled: a random sample of what
    pre-training reads), decoded: in the log, the stage's MLflow run and its folder (SAMPLE_FILE)."""
    fs, path = storage.resolve(shard_uri)
    with fs.open_input_file(path) as f:
        head = pa.Table.from_batches([next(pq.ParquetFile(f).iter_batches(batch_size=SAMPLE_INSTANCES))])
    # Named relative to the stage folder: the file's bytes are the same wherever the workdir is.
    name = shard_uri[len(ctx.output_uri.rstrip("/")) + 1:] if shard_uri.startswith(ctx.output_uri) else shard_uri
    text = f"{name}, its first {head.num_rows} instances:\n\n" + describe_instances(head, tokens)
    log.info("pairs: what BERT will see: %s", text)
    ctx.log_text(text, SAMPLE_FILE)
    storage.write_text_atomic(storage.join(ctx.output_uri, SAMPLE_FILE), text)
    return text


# ------------------------------------------------------------------------------------------------ the stage


def describe_raw_inputs(cfg: PairsConfig) -> list[dict]:
    """None: pairs reads only stage outputs (the documents and the vocabulary), which enter its fingerprint by their
    manifests' output ids."""
    return []


def preflight(ctx: StageContext) -> None:
    """Before Ray starts: a vocab.txt the user names (vocab.path) reads as UTF-8 and has the special tokens."""
    path = ctx.section(VocabConfig).path
    if path:
        load_vocab(path)


def _lowercase(ctx: StageContext) -> bool:
    """do_lower_case as the vocab stage recorded it (its manifest), else the vocab config, else BERT's default."""
    extra = (ctx.input("vocab").manifest or {}).get("extra", {})
    if "do_lower_case" in extra:
        return bool(extra["do_lower_case"])
    cfg = [v for v in ctx.config.values() if isinstance(v, VocabConfig)]
    return cfg[0].lowercase if cfg else True


def task_memory(max_task_bytes: int) -> int:
    """What each task asks Ray for: `max_task_bytes` (Ray then runs on a node only as many tasks as its `memory`
    resource holds), or the most any node offers, where that is less: a request no node can meet waits forever."""
    import ray

    most = int(max((n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")), default=0))
    if 0 < most < max_task_bytes:
        log.warning("pairs: pairs.max_task_bytes is %.2f GiB but the largest node offers Ray tasks %.2f GiB: each "
                    "task asks for that", max_task_bytes / 2**30, most / 2**30)
        return most
    return max_task_bytes


def _advice(cfg: PairsConfig, kill: memory_kills.MemoryKill) -> str:
    """What to set, for a task of this stage killed for memory."""
    budget = f"pairs.max_task_bytes ({cfg.max_task_bytes / 2**30:.2f} GiB)"
    if kill.task_gb is not None and kill.task_gb * 1e9 > 1.1 * cfg.max_task_bytes:
        also = " or pairs.docs_per_partition" if "pair_docs" in kill.task else ""
        return f"it held more than {budget}: lower pairs.max_task_bytes{also}, so that each task holds less"
    return (f"it held no more than {budget}: the node's memory went to other processes; free memory on the node "
            f"or lower ray.num_cpus so that fewer tasks run at once")


def _document_counts(files: list[str]) -> list[int | None]:
    """Documents per input file, from the Parquet footers (None for a text file)."""
    counts: list[int | None] = []
    for uri in files:
        if uri.endswith(".parquet"):
            try:
                fs, path = storage.resolve(uri)
                with fs.open_input_file(path) as f:
                    counts.append(pq.ParquetFile(f).metadata.num_rows)
            except (OSError, pa.ArrowException) as exc:
                raise StageInputError(f"cannot read documents {uri}: {exc}") from exc
        else:
            counts.append(None)
    return counts


def _first_pass(ctx: StageContext, cfg: PairsConfig, files: list[str], batch_kwargs: dict, memory: int) -> list[dict]:
    """One task per pool, each reading its own documents: their counter rows, sorted by key.

    Not a Ray Data job over the documents: Ray Data reads documents ahead of the pairing tasks up to its share of
    the object store, which a corpus larger than that fills (0.7 GB at x300 here, and more with the corpus), and
    capped lower it ran one pairing task at a time (a 256 MiB cap: pass 1 took 301 s instead of 201 s at x300)."""
    import ray

    counts = _document_counts(files)
    plan = plan_pools(files, counts, cfg.docs_per_partition)
    known = sum(counts) if None not in counts else None
    task = ray.remote(pair_docs).options(num_cpus=1, memory=memory)
    with ctx.console.remote_progress("pairs", known, "docs") as progress:
        refs = [task.remote(ranges, docs_per_partition=cfg.docs_per_partition, progress=progress, **batch_kwargs)
                for ranges in plan]
        rows = [row for chunk in ray.get(refs) for row in chunk]
    return sorted(rows, key=lambda r: r["key"])


def _submit_length(ctx, cfg, rows, length, seed, schema, parts_uri, memory) -> tuple:
    """The tasks that write the equal-row shards of one length from the part files (cells sized by data:
    `plan_shards`) and its held-out shard: (plan, their refs, the held-out task's ref)."""
    import ray

    counts = [r[f"rows_{length}"] for r in rows]
    total, nbytes = sum(counts), sum(r[f"bytes_{length}"] for r in rows)
    local = not storage.is_remote(parts_uri)
    plan = plan_shards(counts, cfg.num_shards, cell_rows(cfg.max_task_bytes, nbytes / max(total, 1), local))
    if plan.rows_per_shard == 0:
        raise StageInputError(f"{ctx.input('clean').uri} yields {total} instances at max_seq_length={length}: "
                              f"too few for pairs.num_shards={cfg.num_shards}")
    group_rows = row_group_rows(nbytes / max(total, 1))
    schema_bytes = schema.serialize().to_pybytes()
    part_dir = storage.join(parts_uri, shards.seq_dir(length))
    out_dir = storage.join(ctx.output_uri, shards.seq_dir(length))
    parts = ray.put([storage.join(part_dir, f"train-{r['key']}.arrow") for r in rows])
    task = ray.remote(write_cells).options(num_cpus=1, memory=memory)
    pending = []
    for cells in plan.tasks:
        targets = {i: storage.join(out_dir, shards.train_shard_name(i))
                   for c in cells for i, _ in plan.cells[c].shards}
        seeds = [derive_seed(seed, "cell", length, c) % 2**32 for c in cells]
        pending.append(task.remote(parts, [plan.cells[c] for c in cells], seeds, targets, schema_bytes, group_rows))
    held_parts = [storage.join(part_dir, f"heldout-{r['key']}.arrow") for r in rows if r[f"held_{length}"]]
    held = ray.remote(concat_parts).options(num_cpus=1, memory=memory).remote(
        held_parts, storage.join(out_dir, shards.HELDOUT_NAME), schema_bytes, group_rows)
    return plan, pending, held


def _length_metrics(cfg, rows, length, plan, results, held_rows) -> dict:
    """The counters of one length, checked against what its tasks wrote."""
    written = {i: n for r in results for i, n in r["rows"].items()}
    assert sorted(written) == list(range(cfg.num_shards)) and set(written.values()) == {plan.rows_per_shard}, \
        f"shards hold {written}, expected {cfg.num_shards} x {plan.rows_per_shard} rows"
    total, nbytes = sum(r[f"rows_{length}"] for r in rows), sum(r[f"bytes_{length}"] for r in rows)
    sums = {name: sum(r[f"{name}_{length}"] for r in rows) for name in COUNTERS}
    kept = plan.rows_per_shard * cfg.num_shards
    held_most = max((sum(e - f for _, f, e in c.slices) for c in plan.cells), default=0)
    clocks = {k: sum(r[k] for r in results) for k in ("read_s", "shuffle_s", "write_s")}
    log.info("pairs: seq %d: %d instances (%.1f%% NotNext, %.0f MB) -> %d shards x %d rows through %d cells of at most "
             "%d rows (%.0f MB), %d dropped, %d held out; CPU-s: read %.1f, shuffle %.1f, write %.1f",
             length, total, 100 * sums["random_next"] / max(total, 1), nbytes / 1e6, cfg.num_shards,
             plan.rows_per_shard, len(plan.cells), held_most, held_most * nbytes / max(total, 1) / 1e6, total - kept,
             held_rows, *clocks.values())
    return {
        f"instances_seq{length}": total,
        f"instances_written_seq{length}": kept,
        f"heldout_instances_seq{length}": held_rows,
        f"rows_dropped_for_equal_shards_seq{length}": total - kept,
        f"nsp_random_fraction_seq{length}": sums["random_next"] / max(total, 1),
        f"short_target_fraction_seq{length}": sums["short_targets"] / max(sums["doc_passes"], 1),
        f"no_other_document_chunks_seq{length}": sums["no_other_document"],
        f"instance_tokens_seq{length}": sums["instance_tokens"],
        f"instance_bytes_seq{length}": nbytes,
        f"cells_seq{length}": len(plan.cells),
        f"cell_rows_max_seq{length}": held_most,
        **{f"pass2_{k}_seq{length}": v for k, v in clocks.items()},
    }


def _second_pass(ctx, cfg, rows, seeds, schemas, parts_uri, memory) -> dict:
    """Every length's shards at once: a length's last tasks leave no core idle while the next one's wait."""
    import ray

    submitted = {length: _submit_length(ctx, cfg, rows, length, seeds[length], schemas[length], parts_uri, memory)
                 for length in cfg.max_seq_lengths}
    metrics = {}
    for length, (plan, pending, held) in submitted.items():
        metrics.update(_length_metrics(cfg, rows, length, plan, ray.get(pending), ray.get(held)))
    return metrics


def _pass1_metrics(rows: list[dict], seconds: float) -> dict:
    """Pass 1's counts and where its time went (logged too)."""
    out = {"documents": sum(r["documents"] for r in rows), "pools": len(rows), "tokens": sum(r["tokens"] for r in rows),
           "pass1_seconds": seconds, **{f"pass1_{k}": sum(r[k] for r in rows) for k in PASS1_CLOCKS}}
    log.info("pairs: %d documents, %d tokens paired in %d pools in %.1f s (%.0f tokens/s; CPU-s: tokenize %.1f, "
             "pair %.1f, write parts %.1f)", out["documents"], out["tokens"], len(rows), seconds,
             out["tokens"] / max(seconds, 1e-9), *(out[f"pass1_{k}"] for k in PASS1_CLOCKS))
    return out


def _stage_metrics(cfg: PairsConfig, per_length: dict, pass1: dict, pass2: float, memory: int, kills: int,
                   seconds: float) -> dict:
    """The stage's metrics: every length's, pass 1's, and the headline figures of the first length."""
    first = cfg.max_seq_lengths[0]
    return {
        **per_length,
        **pass1,
        "tokens_per_second": pass1["tokens"] / max(seconds, 1e-9),
        "nsp_random_fraction": per_length[f"nsp_random_fraction_seq{first}"],
        "short_target_fraction": per_length[f"short_target_fraction_seq{first}"],
        "rows_dropped_for_equal_shards": sum(per_length[f"rows_dropped_for_equal_shards_seq{L}"]
                                             for L in cfg.max_seq_lengths),
        "pass2_seconds": pass2,
        "task_memory_bytes": memory,
        "tasks_killed_for_memory": kills,
        "seconds": round(seconds, 3),
    }


def run_stage(ctx: StageContext) -> StageResult:
    cfg = ctx.section(PairsConfig)
    started = time.time()
    vocab_uri = vocab_file(ctx.input("vocab").uri)
    tokens_list = load_vocab(vocab_uri)
    specials = special_ids(tokens_list)
    lowercase = _lowercase(ctx)
    docs = ctx.input("clean")
    files = document_files(docs.uri, docs.manifest)
    v_hash = vocab_hash(vocab_uri)
    parts_uri = storage.join(ctx.output_uri, PASS_PARTS_DIR)
    seeds = {length: derive_seed(ctx.seed, "pairs", length) % 2**31 for length in cfg.max_seq_lengths}
    pair_kwargs = dict(short_seq_prob=cfg.short_seq_prob, cls_id=specials["[CLS]"], sep_id=specials["[SEP]"],
                       id_type=shards.id_type(len(tokens_list)))
    memory = task_memory(cfg.max_task_bytes)
    metrics: dict[str, float] = {}
    with memory_kills.told(ctx.console, "pairs", functools.partial(_advice, cfg), log) as kills:
        rows = _first_pass(ctx, cfg, files, dict(
            vocab_uri=vocab_uri, lowercase=lowercase, seeds=seeds, heldout_fraction=cfg.heldout_fraction,
            dupe_factor=cfg.dupe_factor, parts_uri=parts_uri, pair_kwargs=pair_kwargs,
            pool_bytes=pool_text_limit(cfg.max_task_bytes)), memory)
        pass1 = _pass1_metrics(rows, time.time() - started)
        meta_common = dict(vocab_hash=v_hash, vocab_size=len(tokens_list), do_lower_case=lowercase,
                           special_ids=specials)
        schemas = {length: shards.shard_schema(len(tokens_list), length,
                                               shards.shard_meta(max_seq_length=length, **meta_common))
                   for length in cfg.max_seq_lengths}
        metrics.update(_second_pass(ctx, cfg, rows, seeds, schemas, parts_uri, memory))
        pass2 = time.time() - started - pass1["pass1_seconds"]
    storage.delete_dir(parts_uri)
    first_shard = storage.join(ctx.output_uri, shards.seq_dir(cfg.max_seq_lengths[0]), shards.train_shard_name(0))
    show_instances(ctx, first_shard, tokens_list)

    metrics = _stage_metrics(cfg, metrics, pass1, pass2, memory, len(kills), time.time() - started)
    metrics = {k: float(v) for k, v in metrics.items()}
    ctx.log_metrics(metrics, None)
    return StageResult(
        num_rows=int(sum(metrics[f"instances_written_seq{L}"] for L in cfg.max_seq_lengths)),
        metrics=metrics,
        extra={"vocab_hash": v_hash, "max_seq_lengths": list(cfg.max_seq_lengths), "num_shards": cfg.num_shards},
        outputs=[f"{shards.seq_dir(L)}/{name}" for L in cfg.max_seq_lengths
                 for name in [*map(shards.train_shard_name, range(cfg.num_shards)), shards.HELDOUT_NAME]],
    )
