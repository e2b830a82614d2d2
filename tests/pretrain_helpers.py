"""Committed vocab + pairs stage folders of structured synthetic shards, and a StageContext for the pretrain stage.

The shards are learnable by a tiny model in a few dozen steps: the 40 words form 8 topics of 5; segment A draws
its words from one topic, segment B from the same topic when IsNext and from another topic when NotNext. A model
that reads the context predicts a masked word at ~1/5 (the most-frequent-token baseline is ~1/40) and NSP well
above chance."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from bertpipe.jobs.pretrain.config import ModelConfig, PhaseConfig, PretrainConfig
from bertpipe.pipeline.formats.shards import seq_dir, shard_meta, shard_schema, train_shard_name, write_shard
from bertpipe.pipeline.framework.console import Console
from bertpipe.pipeline.framework.stage import StageContext, StageInput, StageResult, read_manifest, write_manifest
from bertpipe.pipeline.formats.vocabulary import vocab_hash

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
NUM_WORDS = 40
NUM_TOPICS, TOPIC_SIZE = 8, 5
TOKENS = SPECIALS + [f"w{i}" for i in range(NUM_WORDS)] + [f"##x{i}" for i in range(3)]
FIRST_WORD = len(SPECIALS)
CLS, SEP = 2, 3


def make_rows(rng: np.random.Generator, n: int, L: int) -> pa.Table:
    ids, b_starts, labels, lengths = [], [], [], []
    for _ in range(n):
        total = int(rng.integers(L // 2, L - 3 + 1))
        a = int(rng.integers(2, total - 1))
        b = total - a
        topic = int(rng.integers(NUM_TOPICS))
        is_next = rng.random() < 0.5
        b_topic = topic if is_next else (topic + int(rng.integers(1, NUM_TOPICS))) % NUM_TOPICS
        a_ids = FIRST_WORD + topic * TOPIC_SIZE + rng.integers(TOPIC_SIZE, size=a)
        b_ids = FIRST_WORD + b_topic * TOPIC_SIZE + rng.integers(TOPIC_SIZE, size=b)
        row = np.concatenate([[CLS], a_ids, [SEP], b_ids, [SEP]]).astype(np.uint16)
        ids.append(row)
        b_starts.append(a + 2)
        labels.append(0 if is_next else 1)
        lengths.append(len(row))
    return pa.table({"input_ids": pa.array(ids, pa.list_(pa.uint16())),
                     "segment_b_start": pa.array(b_starts, pa.int16()),
                     "next_sentence_label": pa.array(labels, pa.int8()),
                     "num_tokens": pa.array(lengths, pa.int16())})


def make_inputs(root: Path, lengths=(32,), rows_per_shard=400, num_shards=3, heldout_rows=160,
                seed=0, vocab_tokens=TOKENS) -> dict[str, StageInput]:
    vocab_dir = root / "vocab"
    vocab_dir.mkdir(parents=True, exist_ok=True)
    (vocab_dir / "vocab.txt").write_text("\n".join(vocab_tokens) + "\n")
    started = time.time()
    write_manifest(str(vocab_dir), stage="vocab", fingerprint="t", result=StageResult(num_rows=len(vocab_tokens)),
                   config={}, inputs={}, started=started, code_version="test")
    vhash = vocab_hash(str(vocab_dir))
    pairs = root / "pairs"
    rng = np.random.default_rng(seed)
    for L in lengths:
        meta = shard_meta(vocab_hash=vhash, vocab_size=len(TOKENS), do_lower_case=True, max_seq_length=L,
                          special_ids={t: i for i, t in enumerate(SPECIALS)})
        schema = shard_schema(len(TOKENS), L, meta)
        for i in range(num_shards):
            write_shard(str(pairs / seq_dir(L) / train_shard_name(i)), make_rows(rng, rows_per_shard, L).cast(schema))
        write_shard(str(pairs / seq_dir(L) / "heldout.parquet"), make_rows(rng, heldout_rows, L).cast(schema))
    write_manifest(str(pairs), stage="pairs", fingerprint="t", result=StageResult(num_rows=1), config={},
                   inputs={}, started=started, code_version="test")
    return {n: StageInput(n, str(root / n), read_manifest(str(root / n))) for n in ("pairs", "vocab")}


def tiny_config(**overrides) -> PretrainConfig:
    base = dict(
        num_workers=2, cpus_per_worker=1, max_steps=40, zero_stage=1,
        phases=(PhaseConfig(max_seq_length=32, max_predictions_per_seq=5, global_batch_size=32,
                            micro_batch_size=8, learning_rate=3e-3, warmup_steps=4),),
        log_every_steps=10, eval_every_steps=0, eval_max_batches=5, checkpoint_every_steps=20,
        shuffle_buffer_rows=200, max_failures=0, weight_decay=0.01)
    base.update(overrides)
    return PretrainConfig(**base)


def context(root: Path, inputs, cfg: PretrainConfig, *, model: ModelConfig | None = None, seed: int = 7,
            tracking: dict | None = None, output: str = "pretrain",
            console: Console | None = None) -> StageContext:
    out = root / output
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(name="pretrain", output_uri=str(out), config={
        "model": model or ModelConfig(preset="tiny", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1),
        "pretrain": cfg}, seed=seed, inputs=inputs, tracking=tracking or {}, console=console or Console())


def with_phases(cfg: PretrainConfig, *phases: PhaseConfig) -> PretrainConfig:
    return dataclasses.replace(cfg, phases=phases)


def export_params(ctx: StageContext) -> dict:
    """The exported model's tensors (model.safetensors in <output>/export), by HF name."""
    from safetensors.torch import load_file

    return load_file(str(Path(ctx.output_uri) / "export" / "model.safetensors"))


def foreign_rig_inputs(root):
    """The multi-node rig's inputs: two small seq-32 shards and held-out rows, with no manifest of ours (shards
    from anywhere), as the elastic and restart tests train on them."""
    make_inputs(root, lengths=(32,), rows_per_shard=400, num_shards=2, heldout_rows=160)
    (root / "pairs" / "_MANIFEST.json").unlink()
    return root
