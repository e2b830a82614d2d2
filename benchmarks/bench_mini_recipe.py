"""Which `mini` recipe learns fastest per CPU-second? A single-process stand-in for the pretrain stage on its real
shards: the same model code, masking (jobs/pretrain/data/masking.py), parameter groups, AdamW, clipping and warmup/decay
schedule, without Ray or DeepSpeed, so several recipes can run side by side on one core each. It prints held-out
MLM accuracy (token-level masks, fixed seed, as the stage's final evaluation) over the most-frequent-token
baseline and held-out NSP accuracy every --eval-every steps.

    .venv/bin/bertpipe run --config configs/mini.yaml --only clean,vocab,pairs      # the shards
    .venv/bin/python benchmarks/bench_mini_recipe.py --pairs work/mini/pairs --vocab work/mini/vocab/vocab.txt \
        --steps 240 --schedule-steps 900 --threads 1 [--lr 1e-3] [--batch 32] [--whole-word 1]

Compare recipes at equal sequences seen (steps x batch), not equal steps. `--mlm-weight 0` trains NSP alone (is it
learnable here at all?); `--save F` then `--init F --seq 512 ...` runs a second phase on the first one's weights.
`--hf-init DIR` starts from a Hugging Face BERT folder (its shape, its weights through the pretrain stage's loader,
jobs/pretrain/init.py; heads it lacks stay initialised); add `--shape-only` for the same shape from random weights,
the arm to compare it with (issue 33: continued pre-training from MiniLM against random initialisation; the shards
then come from `bertpipe run --only clean,vocab,pairs --set pretrain.init=DIR --set model.preset=from-init`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from bertpipe.jobs.pretrain.learning.baselines import baselines
from bertpipe.jobs.pretrain.data.masking import MaskingSpec, mask_batch
from bertpipe.model import BertForPreTraining
from bertpipe.model.config import BertConfig
from bertpipe.model.training import param_groups, warmup_decay

COLUMNS = ("input_ids", "segment_b_start", "next_sentence_label")


def read_rows(files: list[str]) -> dict[str, list]:
    rows: dict[str, list] = {k: [] for k in COLUMNS}
    for f in files:
        table = pq.read_table(f, columns=list(COLUMNS)).to_pydict()
        for k in COLUMNS:
            rows[k] += table[k]
    return rows


def batch_of(rows: dict[str, list], idx) -> dict[str, np.ndarray]:
    ids = np.empty(len(idx), dtype=object)
    ids[:] = [np.asarray(rows["input_ids"][i], dtype=np.uint16) for i in idx]
    return {"input_ids": ids, **{k: np.array([rows[k][i] for i in idx]) for k in COLUMNS[1:]}}


def evaluate(model, rows, spec) -> tuple[float, float]:
    """Held-out (MLM accuracy, NSP accuracy) with fixed token-level masks."""
    model.eval()
    rng = np.random.default_rng(99)
    mlm_right = mlm_count = nsp_right = 0
    n = len(rows["input_ids"])
    with torch.no_grad():
        for i in range(0, n, 64):
            b = mask_batch(batch_of(rows, range(i, min(i + 64, n))), spec, rng)
            out = model(**b)
            mlm_right += int(out.mlm_correct)
            mlm_count += int(out.mlm_count)
            nsp_right += int(out.nsp_correct)
    model.train()
    return mlm_right / max(1, mlm_count), nsp_right / max(1, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=Path, required=True, help="a pairs stage folder")
    ap.add_argument("--vocab", type=Path, required=True)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--schedule-steps", type=int, default=0,
                    help="length of the warmup/decay schedule (default --steps)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--whole-word", type=int, default=1)
    ap.add_argument("--max-predictions", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--eval-every", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mlm-weight", type=float, default=1.0, help="0 trains NSP alone (is NSP learnable here?)")
    ap.add_argument("--nsp-weight", type=float, default=1.0)
    ap.add_argument("--init", type=Path, help="start from a state dict --save wrote (a second phase)")
    ap.add_argument("--save", type=Path, help="write the model's state dict here at the end")
    ap.add_argument("--hf-init", type=Path, help="a Hugging Face BERT folder: its shape and weights")
    ap.add_argument("--shape-only", action="store_true", help="with --hf-init: its shape, random weights")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokens = args.vocab.read_text(encoding="utf-8").splitlines()
    folder = args.pairs.resolve() / f"seq{args.seq}"
    train_files = sorted(str(folder / f) for f in os.listdir(folder) if f.startswith("train-"))
    train, held = read_rows(train_files), read_rows([str(folder / "heldout.parquet")])
    train_spec = MaskingSpec.from_vocab(tokens, max_seq_length=args.seq, max_predictions=args.max_predictions,
                                        whole_word=bool(args.whole_word))
    eval_spec = MaskingSpec.from_vocab(tokens, max_seq_length=args.seq, max_predictions=args.max_predictions)
    base = baselines(train_files, str(folder / "heldout.parquet"), eval_spec)["baseline_mlm_accuracy"]
    config = BertConfig(vocab_size=len(tokens), hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.hidden // 64, intermediate_size=4 * args.hidden,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if args.hf_init:
        config = BertConfig.from_hf_dict(json.loads((args.hf_init / "config.json").read_text()))
        config = dataclasses.replace(config, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForPreTraining(config)
    if args.hf_init and not args.shape_only:
        from bertpipe.jobs.pretrain.init import load_into

        print("initialised (not in the checkpoint):", ", ".join(sorted(load_into(model, str(args.hf_init)))))
    if args.init:
        model.load_state_dict(torch.load(args.init))
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=args.lr, eps=1e-6)
    total = args.schedule_steps or args.steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_decay(s, total, args.warmup))
    n = len(train["input_ids"])
    print(json.dumps({k: str(v) for k, v in vars(args).items()}), f"\ntrain rows {n}, held-out rows "
          f"{len(held['input_ids'])}, MLM baseline {base:.3f}", flush=True)
    print("| step | sequences | train loss | train NSP | held-out MLM | x baseline | held-out NSP | s |\n"
          "|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(args.seed)
    order, pos, loss_sum, losses, t0 = rng.permutation(n), 0, 0.0, 0, time.perf_counter()
    nsp_right = 0
    for step in range(1, args.steps + 1):
        if pos + args.batch > n:
            order, pos = rng.permutation(n), 0
        out = model(**mask_batch(batch_of(train, order[pos:pos + args.batch]), train_spec, rng))
        pos += args.batch
        (args.mlm_weight * out.mlm_loss + args.nsp_weight * out.nsp_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        loss_sum, losses = loss_sum + float(out.loss.detach()), losses + 1
        nsp_right += int(out.nsp_correct)
        if step % args.eval_every == 0 or step == args.steps:
            mlm, nsp = evaluate(model, held, eval_spec)
            train_nsp = nsp_right / (losses * args.batch)
            print(f"| {step} | {step * args.batch} | {loss_sum / losses:.3f} | {train_nsp:.3f} | {mlm:.3f} | "
                  f"{mlm / base:.2f} | {nsp:.3f} | {time.perf_counter() - t0:.0f} |", flush=True)
            loss_sum, losses, nsp_right = 0.0, 0, 0
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
