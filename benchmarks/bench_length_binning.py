"""Length binning on real shards: padding and training-step time with and without it, in one run.

Builds clean → vocab → pairs from the real enwiki sample (the tiny preset's data settings: dupe_factor 2, both
sequence lengths) unless `--pairs DIR` names a committed pairs folder, then, per sequence length, cuts the train
rows into micro-batches in shard order (a) as they come and (b) length-binned (`jobs/pretrain/data/length_binning.py`,
the pre-training default window), and reports the share of padded slots and the time of forward + backward + AdamW
on the same rows, the two sides interleaved batch by batch so a busy spell on the machine hits both.

    python benchmarks/bench_length_binning.py [--preset mini] [--batches 24] [--window 8] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MICRO = {128: 16, 512: 4}  # the tiny preset's micro-batches (BERT-Large on a GPU uses 64 / 8-16)
SAMPLE = REPO / "data" / "sample" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def build_pairs(workdir: Path) -> Path:
    import ray

    from bertpipe.jobs import workflow
    from bertpipe.jobs.config import load_config

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    try:
        cfg = load_config("tiny", [f"clean.input=[{SAMPLE}]", "mlflow.tracking_uri='off'"], str(workdir))
        workflow.run(cfg, only=["clean", "vocab", "pairs"])
    finally:
        ray.shutdown()
    return workdir / "pairs"


def read_rows(pairs: Path, L: int) -> tuple[dict[str, np.ndarray], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bertpipe.pipeline.formats.shards import list_shards

    files, _ = list_shards(str(pairs), L)
    table = pa.concat_tables([pq.read_table(f) for f in files])
    rows = np.empty(table.num_rows, dtype=object)
    rows[:] = [np.asarray(r, dtype=np.int64) for r in table.column("input_ids").to_pylist()]
    vocab = (pairs.parent / "vocab" / "vocab.txt").read_text().splitlines()
    return {"input_ids": rows, "segment_b_start": table.column("segment_b_start").to_numpy(),
            "next_sentence_label": table.column("next_sentence_label").to_numpy(),
            "num_tokens": table.column("num_tokens").to_numpy()}, vocab


def cut(rows: dict[str, np.ndarray], size: int) -> list[dict[str, np.ndarray]]:
    n = len(rows["num_tokens"]) // size * size  # drop_last, as the training loop
    return [{k: v[i:i + size] for k, v in rows.items()} for i in range(0, n, size)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", help="a committed pairs stage folder (default: build one from the sample)")
    ap.add_argument("--preset", default="mini", help="model size timed (model.PRESETS)")
    ap.add_argument("--batches", type=int, default=24, help="timed micro-batches per side and length")
    ap.add_argument("--window", type=int, default=None, help="binning window (default: the pretrain default)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from bertpipe.jobs.pretrain.data.length_binning import length_binned, padding_fraction, row_lengths
    from bertpipe.jobs.pretrain.data.masking import MaskingSpec, batch_rng, mask_batch
    from bertpipe.jobs.pretrain.config import PretrainConfig
    from bertpipe.model import BertConfig, BertForPreTraining

    window = args.window or PretrainConfig().length_bin_window
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        pairs = Path(args.pairs) if args.pairs else build_pairs(Path(tmp))
        table = []
        for L, micro in MICRO.items():
            rows, vocab = read_rows(pairs, L)
            plain = cut(rows, micro)
            binned = list(length_binned(plain, window, np.random.default_rng(0)))
            pad = [padding_fraction(np.concatenate([row_lengths(b) for b in side]), micro) for side in (plain, binned)]
            spec = MaskingSpec.from_vocab(vocab, max_seq_length=L, max_predictions=max(1, L * 20 // 128))
            torch.manual_seed(0)
            model = BertForPreTraining(BertConfig.preset(args.preset, vocab_size=len(vocab)))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            seconds, tokens = [0.0, 0.0], [0, 0]
            n = min(args.batches, len(plain))
            # Warm up both shapes' kernels, then interleave the two sides batch by batch.
            for i in range(-2, n):
                for side, batches in enumerate((plain, binned)):
                    b = mask_batch(batches[max(i, 0)], spec, batch_rng(0, 0, 0, 0, max(i, 0)))
                    t0 = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    model(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["masked_positions"],
                          b["masked_lm_labels"], b["next_sentence_label"]).loss.backward()
                    opt.step()
                    if i >= 0:
                        seconds[side] += time.perf_counter() - t0
                        tokens[side] += int(b["attention_mask"].sum())
            rate = [t / s for t, s in zip(tokens, seconds)]
            table.append((L, micro, len(rows["num_tokens"]), pad[0], pad[1], rate[0], rate[1]))
    print(f"\nreal enwiki sample shards, {args.preset} model, window {window} micro-batches, {args.threads} threads, "
          f"{args.batches} timed batches per side")
    print("| seq | micro-batch | rows | padding, plain | padding, binned | real tokens/s plain | binned | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for L, micro, n, p0, p1, r0, r1 in table:
        print(f"| {L} | {micro} | {n} | {100 * p0:.1f}% | {100 * p1:.1f}% | {r0:,.0f} | {r1:,.0f} | {r1 / r0:.2f}× |")


if __name__ == "__main__":
    main()
