"""Where does a pre-trained export's [CLS] look, and which half of the export helps or hurts fine-tuning?

1. For the export and for the same architecture from random initialisation, on a pairs stage's held-out rows: the
   entropy of each head's [CLS] attention over the real tokens (as a share of log n: 1 = a uniform average, i.e. a
   bag of words; near 0 = one token) and the mean largest attention weight. A classifier on the pooled [CLS] sees
   what this attention gathers.
2. With --hybrids DIR: two exports for `bench_pretrain_value.py` that split the pre-trained model in two, the
   pre-trained encoder (everything but the token embedding) with random token embeddings, and random everything
   with the pre-trained token embeddings.

    .venv/bin/python benchmarks/bench_cls_attention.py --export work/mini/pretrain/export --pairs work/mini/pairs \
        --hybrids /tmp/hybrids
    .venv/bin/python benchmarks/bench_pretrain_value.py --export encoder=/tmp/hybrids/pretrained-encoder \
        --export embeddings=/tmp/hybrids/pretrained-embeddings --tasks SST-2 --train-examples 2000 --epochs 3 \
        --batch-size 16 --max-seq-length 64 --lr 5e-4 --threads 1
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from bertpipe.jobs.pretrain.data.masking import MaskingSpec, pad_batch
from bertpipe.model import BertForPreTraining, load_pretrained, save_pretrained


def cls_attention(model: BertForPreTraining, batch: dict[str, torch.Tensor]) -> list[tuple[np.ndarray, ...]]:
    """Per layer: (entropy / log n, largest weight, the token id it falls on in the most rows) of the [CLS] query's
    attention, per head, mean over rows."""
    keep = batch["attention_mask"].bool()  # [B, T]
    log_n = keep.sum(1).double().log()[:, None]  # [B, 1]
    additive = torch.zeros(keep.shape, dtype=torch.float32).masked_fill(~keep, torch.finfo(torch.float32).min)
    additive = additive[:, None, None, :]  # [B, 1, 1, T]
    x = model.bert.embeddings(batch["input_ids"], batch["token_type_ids"])
    out = []
    for layer in model.bert.encoder.layers:
        B, T, H = x.shape
        A = layer.attention.num_heads
        q, k, _ = layer.attention.qkv(x).view(B, T, 3, A, H // A).permute(2, 0, 3, 1, 4).unbind(0)  # [B, A, T, D]
        scores = (q[:, :, :1] @ k.transpose(-1, -2)) / (H // A) ** 0.5 + additive  # [B, A, 1, T]
        p = scores.softmax(-1)[:, :, 0].double()  # [B, A, T]
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [B, A]
        top = batch["input_ids"].gather(1, p.argmax(-1))  # [B, A] token id of the largest weight
        out.append(((entropy / log_n).mean(0).numpy(), p.max(-1).values.mean(0).numpy(),
                    np.array([np.bincount(top[:, h].numpy()).argmax() for h in range(A)])))
        x = layer(x, additive)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", type=Path, required=True, help="a pre-trained export (HF layout)")
    ap.add_argument("--pairs", type=Path, required=True, help="a pairs stage folder (its seq128 held-out rows)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hybrids", type=Path, help="write the two half-pre-trained exports here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokens = (args.export / "vocab.txt").read_text(encoding="utf-8").splitlines()
    pre = load_pretrained(args.export, BertForPreTraining).eval()
    torch.manual_seed(args.seed)
    rnd = BertForPreTraining(pre.config).eval()
    table = pq.read_table(args.pairs / f"seq{args.seq}" / "heldout.parquet").slice(0, args.rows)
    ids = np.empty(table.num_rows, dtype=object)
    ids[:] = [np.asarray(r, dtype=np.int64) for r in table.column("input_ids").to_pylist()]
    spec = MaskingSpec.from_vocab(tokens, max_seq_length=args.seq, max_predictions=1)
    batch = {k: torch.from_numpy(v) for k, v in pad_batch(
        {"input_ids": ids, "segment_b_start": table.column("segment_b_start").to_numpy(),
         "next_sentence_label": table.column("next_sentence_label").to_numpy()}, spec).items()}
    print(f"{table.num_rows} held-out rows at seq {args.seq}\n\n| model | layer | [CLS] attention entropy / log n "
          f"(per head) | largest weight (per head) | token it falls on most |\n|---|---|---|---|---|")
    with torch.no_grad():
        for name, model in (("random init", rnd), ("pre-trained", pre)):
            for i, (entropy, top, token) in enumerate(cls_attention(model, batch)):
                print(f"| {name} | {i} | {' / '.join(f'{e:.3f}' for e in entropy)} | "
                      f"{' / '.join(f'{t:.3f}' for t in top)} | {' / '.join(tokens[t] for t in token)} |")
    if args.hybrids:
        word = "bert.embeddings.word_embeddings.weight"
        for name, body, embedding in (("pretrained-encoder", pre, rnd), ("pretrained-embeddings", rnd, pre)):
            state = dict(body.state_dict())
            state[word] = embedding.state_dict()[word]
            state["mlm.decoder_weight"] = state[word]  # tied: the later key would otherwise win in load_state_dict
            hybrid = BertForPreTraining(pre.config)
            hybrid.load_state_dict(state)
            save_pretrained(hybrid, args.hybrids / name, args.export / "vocab.txt")
        print(f"\nwrote {args.hybrids / 'pretrained-encoder'} and {args.hybrids / 'pretrained-embeddings'}")


if __name__ == "__main__":
    main()
