"""The `vocab` stage: a WordPiece vocabulary trained on the clean corpus with `tokenizers`, or an existing vocab.txt.

Trained vocabularies reproduce the layout of Google's uncased BERT vocabulary: [PAD]=0, [unused0..98]=1..99,
[UNK]=100, [CLS]=101, [SEP]=102, [MASK]=103, then the learned pieces. Other stages still look special ids up by
name (pipeline/formats/vocabulary.py `special_ids`), so any vocab.txt that contains the five special tokens works.

The trainer reads a bounded sample of the corpus (`vocab.max_sample_bytes`, whole row groups drawn at random with
the seed across every file), read once and held in memory for the two uses the algorithm needs: the character
counts that fix the alphabet, then the trainer itself. The rest of the corpus is never read (footers only).
Training is reproducible: the same corpus and config give a byte-identical vocab.txt in any process (see
"deterministic training" below for why `tokenizers` needs help with that).
"""
from __future__ import annotations

import hashlib
import logging
import time
import unicodedata

import numpy as np

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.stages.config import VocabConfig
from bertpipe.pipeline.stages.documents import TextPiece, document_files, iter_piece_texts, sample_pieces, text_pieces
from bertpipe.pipeline.framework.stage import StageContext, StageResult
from bertpipe.pipeline.formats.tokenizer import bert_normalizer, bert_tokenizer
from bertpipe.pipeline.formats.vocabulary import TOKENIZER_FILE, VOCAB_FILE, load_vocab, read_vocab_bytes, vocab_file

log = logging.getLogger(__name__)

# Google's order: [PAD], 99 unused slots, then [UNK] [CLS] [SEP] [MASK] at 100..103.
GOOGLE_SPECIAL_LAYOUT = ("[PAD]", *[f"[unused{i}]" for i in range(99)], "[UNK]", "[CLS]", "[SEP]", "[MASK]")


# ------------------------------------------------------------------------------------- deterministic training
#
# Why `tokenizers` alone is not reproducible (checked against its bpe/trainer.rs, which WordPieceTrainer wraps):
# the word counts live in a Rust std HashMap, whose hasher is seeded from the OS per process (and per map), so
# its iteration order changes every run. Two steps of the trainer depend on that order:
#   1. `tokenize_words` walks the words in map order and gives each continuation piece "##c" the next free id
#      when it first meets it; merges of equal count are then ordered by the ids of their two parts, so which of
#      two tied pairs is merged first (and the ids of everything after) changes run to run;
#   2. with `limit_alphabet`, the characters are sorted by count with an unstable sort, so characters tied at the
#      cut-off are kept or dropped at random.
# RAYON_NUM_THREADS=1 / TOKENIZERS_PARALLELISM=false change neither (measured: three single-threaded runs gave
# three vocabularies), and the Python API cannot seed the hasher or take pre-counted words. What we can do is hand
# the trainer everything whose id it would otherwise assign in map order:
#   - we count the corpus characters ourselves, choose the alphabet (most frequent first, ties by code point) and
#     pass it as `initial_alphabet` with `limit_alphabet=len(alphabet)`, so exactly those characters survive;
#   - every "##c" the trainer could create is registered up front, in code-point order, through the trainer's
#     `special_tokens` (the only way into its id table before `tokenize_words`), so no id is assigned in map order.
# What is left in map order only decides between two heap entries of the *same* pair with the *same* count, which
# arises when one string is reached by two different merges; we have not seen it change a vocabulary (5 processes
# at 30,522 with min_frequency=1 on the enwiki sample: one vocabulary). Cost: one extra read of the corpus for the
# character counts, and a "##c" for a letter that never continues a word takes a slot unused (Google's vocabulary
# has such entries too).


def _is_punctuation(ch: str) -> bool:
    """BertPreTokenizer's split characters: ASCII punctuation/symbols and Unicode P* (always a word of their own)."""
    cp = ord(ch)
    return 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or unicodedata.category(ch)[0] == "P"


def _is_cjk(ch: str) -> bool:
    """The CJK blocks that BertNormalizer pads with spaces (so they never continue a word)."""
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
               (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def count_raw_chars(texts: list[str], counts: dict[int, int]) -> None:
    """Add the code-point counts of `texts` to `counts` (numpy over UTF-32: ~100x a Python loop)."""
    if not texts:
        return
    cps = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
    ascii_counts = np.bincount(cps[cps < 128], minlength=128)
    for cp in np.flatnonzero(ascii_counts):
        counts[int(cp)] = counts.get(int(cp), 0) + int(ascii_counts[cp])
    values, freq = np.unique(cps[cps >= 128], return_counts=True)
    for cp, n in zip(values.tolist(), freq.tolist()):
        counts[cp] = counts.get(cp, 0) + n


def training_alphabet(raw_counts: dict[int, int], lowercase: bool, limit: int) -> list[str]:
    """The `limit` most frequent characters of the *normalized* corpus, ties broken by code point, sorted.

    BertNormalizer works character by character (control removal, CJK spacing, NFD + accent stripping, lowercase),
    so the normalized counts follow from normalizing each distinct raw character once.
    """
    normalizer = bert_normalizer(lowercase)
    counts: dict[str, int] = {}
    for cp, n in raw_counts.items():
        for ch in normalizer.normalize_str(chr(cp)):
            if not ch.isspace():
                counts[ch] = counts.get(ch, 0) + n
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], ord(kv[0])))
    return sorted((ch for ch, _ in ranked[:limit]), key=ord)


def continuation_pieces(alphabet: list[str]) -> list[str]:
    """"##c" for every alphabet character that can sit inside a word (not punctuation, not CJK), in alphabet order."""
    return [f"##{ch}" for ch in alphabet if not _is_punctuation(ch) and not _is_cjk(ch)]


def train_vocab(pieces: list[TextPiece], cfg: VocabConfig) -> list[str]:
    """Train WordPiece on the documents of `pieces`: the same pieces and config give the same tokens, in any
    process.

    Layout: Google's specials at 0..103, then the alphabet, then the "##c" pieces, then the learned pieces in the
    order they were learned.
    """
    batches = list(iter_piece_texts(pieces))  # bounded by vocab.max_sample_bytes; used twice below
    raw_counts: dict[int, int] = {}
    for texts in batches:
        count_raw_chars(texts, raw_counts)
    alphabet = training_alphabet(raw_counts, cfg.lowercase, cfg.limit_alphabet)
    pieces = continuation_pieces(alphabet)
    # The trainer replaces the WordPiece model whole: only the normalizer and pre-tokenizer shape what it learns.
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = bert_normalizer(cfg.lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        limit_alphabet=len(alphabet),
        initial_alphabet=alphabet,
        special_tokens=[*GOOGLE_SPECIAL_LAYOUT, *pieces],
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter(batches), trainer=trainer)
    by_id = sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    assert [i for _, i in by_id] == list(range(len(tokens))), "trained ids are not contiguous"
    assert tokens[:len(GOOGLE_SPECIAL_LAYOUT)] == list(GOOGLE_SPECIAL_LAYOUT), "specials moved"
    registered = set(pieces)
    stray = [t for t in tokens if len(t) == 3 and t.startswith("##") and t not in registered]
    if stray:
        # A "##c" we did not register got its id in hash-map order: this vocabulary may not be reproducible.
        log.warning("vocab: %d continuation pieces were not pre-registered (e.g. %s); the vocabulary may differ "
                    "between runs", len(stray), stray[:5])
    # The specials stay first; single characters before their "##" forms (Google's order), merges as learned.
    head, rest = tokens[:len(GOOGLE_SPECIAL_LAYOUT)], tokens[len(GOOGLE_SPECIAL_LAYOUT):]
    chars = [t for t in rest if len(t) == 1]
    return head + chars + [t for t in rest if len(t) != 1]


def _train_remote(pieces: list[TextPiece], cfg: VocabConfig) -> list[str]:
    return train_vocab(pieces, cfg)


def describe_raw_inputs(cfg: VocabConfig) -> list[dict]:
    """An existing vocab.txt enters the fingerprint by size and checksum (a replaced file makes the stage stale)."""
    if not cfg.path:
        return []
    data = read_vocab_bytes(vocab_file(cfg.path))
    return [{"uri": cfg.path, "size": len(data), "checksum": hashlib.sha256(data).hexdigest()}]


def preflight(ctx: StageContext) -> None:
    """Before Ray starts: a vocab.txt the user names (vocab.path) reads as UTF-8 and has the special tokens, for the
    vocab stage and for the stages that take it as their vocabulary."""
    path = ctx.section(VocabConfig).path
    if path:
        load_vocab(path)


def run_stage(ctx: StageContext) -> StageResult:
    cfg = ctx.section(VocabConfig)
    started = time.time()
    out_vocab = storage.join(ctx.output_uri, VOCAB_FILE)
    if cfg.path:
        tokens = load_vocab(cfg.path)
        data = read_vocab_bytes(vocab_file(cfg.path))
        source = "existing"
        raw_inputs = describe_raw_inputs(cfg)
        log.info("vocab: using existing %s (%d tokens)", cfg.path, len(tokens))
    else:
        if cfg.vocab_size <= len(GOOGLE_SPECIAL_LAYOUT):
            raise ValueError(f"vocab.vocab_size={cfg.vocab_size} leaves no room beside the "
                             f"{len(GOOGLE_SPECIAL_LAYOUT)} special slots")
        docs = ctx.input("clean")
        pieces = text_pieces(document_files(docs.uri, docs.manifest))
        sample = sample_pieces(pieces, cfg.max_sample_bytes, ctx.seed)
        corpus_bytes, sample_bytes = sum(p.num_bytes for p in pieces), sum(p.num_bytes for p in sample)
        log.info("vocab: training WordPiece (target %d) on %.1f MB sampled from %.1f MB of text", cfg.vocab_size,
                 sample_bytes / 1e6, corpus_bytes / 1e6)
        import ray

        if ray.is_initialized():
            # Train on a worker, not the driver: the driver may be a small head node.
            tokens = ray.get(ray.remote(_train_remote).remote(sample, cfg))
        else:
            tokens = train_vocab(sample, cfg)
        data = ("\n".join(tokens) + "\n").encode("utf-8")
        source = "trained"
        raw_inputs = []
        # Rebuilt from the final vocabulary: the trained tokenizer carries the "##c" pieces as added tokens.
        storage.write_text_atomic(storage.join(ctx.output_uri, TOKENIZER_FILE),
                                  bert_tokenizer(tokens, cfg.lowercase).to_str())
    storage.write_text_atomic(out_vocab, data.decode("utf-8"))
    # Validate what we wrote exactly as downstream stages will read it.
    load_vocab(out_vocab)
    metrics = {
        **({"corpus_text_mb": round(corpus_bytes / 1e6, 3), "sample_text_mb": round(sample_bytes / 1e6, 3)}
           if source == "trained" else {}),
        "vocab_size": float(len(tokens)),
        "vocab_size_target": float(cfg.vocab_size),
        "seconds": round(time.time() - started, 3),
    }
    log.info("vocab: %s vocabulary of %d tokens -> %s", source, len(tokens), out_vocab)
    ctx.log_metrics(metrics, None)
    return StageResult(
        num_rows=len(tokens),
        metrics=metrics,
        raw_inputs=raw_inputs,
        extra={"vocab_hash": hashlib.sha256(data).hexdigest(), "source": source, "do_lower_case": cfg.lowercase},
        outputs=[VOCAB_FILE],
    )
