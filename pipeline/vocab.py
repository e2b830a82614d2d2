"""The `vocab` stage: a WordPiece vocabulary trained on the clean corpus with `tokenizers`, or an existing vocab.txt.

Trained vocabularies reproduce the layout of Google's uncased BERT vocabulary: [PAD]=0, [unused0..98]=1..99,
[UNK]=100, [CLS]=101, [SEP]=102, [MASK]=103, then the learned pieces. Other stages still look special ids up by
name (`special_ids`), so any vocab.txt that contains the five special tokens works.

The corpus is streamed to the trainer one Parquet record batch at a time; the text is never held whole.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from pipeline import storage
from pipeline.config import VocabConfig
from pipeline.stage import StageContext, StageInputError, StageResult

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Google's order: [PAD], 99 unused slots, then [UNK] [CLS] [SEP] [MASK] at 100..103.
GOOGLE_SPECIAL_LAYOUT = ("[PAD]", *[f"[unused{i}]" for i in range(99)], "[UNK]", "[CLS]", "[SEP]", "[MASK]")
VOCAB_FILE = "vocab.txt"
TOKENIZER_FILE = "tokenizer.json"


def vocab_file(uri: str) -> str:
    """A vocab.txt URI from either the file itself or the vocab stage's output folder."""
    return uri if uri.endswith(".txt") else storage.join(uri, VOCAB_FILE)


def _read_bytes(uri: str) -> bytes:
    fs, path = storage.resolve(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except (FileNotFoundError, OSError) as exc:
        raise StageInputError(f"cannot read vocabulary {uri}: {exc}") from exc


def vocab_hash(path_or_uri: str) -> str:
    """sha256 of the vocab.txt bytes: the identity shards and checkpoints are checked against."""
    return hashlib.sha256(_read_bytes(vocab_file(path_or_uri))).hexdigest()


def load_vocab(path: str) -> list[str]:
    """The tokens of a vocab.txt (one per line, id = line number), checked for the special tokens and duplicates."""
    uri = vocab_file(path)
    try:
        text = _read_bytes(uri).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StageInputError(f"vocabulary {uri} is not UTF-8 text: {exc}") from exc
    tokens = text.split("\n")
    if tokens and tokens[-1] == "":
        tokens.pop()  # trailing newline
    tokens = [t.rstrip("\r") for t in tokens]
    if not tokens:
        raise StageInputError(f"vocabulary {uri} is empty")
    present = set(tokens)
    missing = [t for t in SPECIAL_TOKENS if t not in present]
    if missing:
        raise StageInputError(f"vocabulary {uri} lacks the special tokens {missing} (needs all of {list(SPECIAL_TOKENS)})")
    if len(present) != len(tokens):
        seen, dupes = set(), []
        for t in tokens:
            if t in seen:
                dupes.append(t)
            seen.add(t)
        raise StageInputError(f"vocabulary {uri} has duplicate tokens, e.g. {dupes[:5]}")
    return tokens


def special_ids(tokens: list[str]) -> dict[str, int]:
    index = {t: i for i, t in enumerate(tokens)}
    return {t: index[t] for t in SPECIAL_TOKENS}


def _bert_pipeline(tokenizer: Tokenizer, lowercase: bool) -> Tokenizer:
    # strip_accents=None follows `lowercase`, like Google's BasicTokenizer (uncased strips accents, cased keeps them).
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def make_tokenizer(vocab_path: str, lowercase: bool) -> Tokenizer:
    """A BERT WordPiece tokenizer over a (validated) vocab.txt; no post-processor, callers add [CLS]/[SEP].

    Special tokens are not registered as added tokens: like Google's FullTokenizer, a literal "[SEP]" in the text
    is tokenized as "[", "sep", "]" and never becomes a separator.
    """
    tokens = load_vocab(vocab_path)
    model = models.WordPiece(
        vocab={t: i for i, t in enumerate(tokens)}, unk_token="[UNK]", max_input_chars_per_word=100
    )
    return _bert_pipeline(Tokenizer(model), lowercase)


def clean_files(clean_uri: str) -> list[str]:
    """The clean stage's document files, sorted (so training sees the corpus in a fixed order)."""
    files = [storage.join(clean_uri, p) for p, _ in storage.list_files(clean_uri) if p.endswith(".parquet")]
    if not files:
        raise StageInputError(f"no Parquet documents in {clean_uri}")
    return files


def iter_texts(files: list[str], batch_rows: int = 1024) -> Iterator[list[str]]:
    """Document texts, one record batch at a time (bounded memory whatever the corpus size)."""
    for uri in files:
        fs, path = storage.resolve(uri)
        try:
            with fs.open_input_file(path) as f:
                parquet = pq.ParquetFile(f)
                if "text" not in parquet.schema_arrow.names:
                    raise StageInputError(f"{uri} has no `text` column (columns: {parquet.schema_arrow.names})")
                for batch in parquet.iter_batches(batch_size=batch_rows, columns=["text"]):
                    yield [t for t in batch.column(0).to_pylist() if t]
        except (OSError, pa.ArrowException) as exc:
            raise StageInputError(f"cannot read clean documents {uri}: {exc}") from exc


def train_tokenizer(files: list[str], cfg: VocabConfig) -> Tokenizer:
    """Train WordPiece on the documents in `files`; specials take Google's ids 0..103."""
    tokenizer = _bert_pipeline(Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100)), cfg.lowercase)
    trainer = trainers.WordPieceTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        limit_alphabet=cfg.limit_alphabet,
        special_tokens=list(GOOGLE_SPECIAL_LAYOUT),
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_texts(files), trainer=trainer)
    return tokenizer


def vocab_from_tokenizer(tokenizer: Tokenizer) -> list[str]:
    by_id = sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    assert [i for _, i in by_id] == list(range(len(tokens))), "trained ids are not contiguous"
    return tokens


def _train_remote(files: list[str], cfg: VocabConfig) -> str:
    return train_tokenizer(files, cfg).to_str()


def run_stage(ctx: StageContext) -> StageResult:
    cfg: VocabConfig = ctx.config["vocab"]
    started = time.time()
    out_vocab = storage.join(ctx.output_uri, VOCAB_FILE)
    if cfg.path:
        tokens = load_vocab(cfg.path)
        data = _read_bytes(vocab_file(cfg.path))
        source = "existing"
        raw_inputs = [{"uri": cfg.path, "size": len(data), "checksum": hashlib.sha256(data).hexdigest()}]
        log.info("vocab: using existing %s (%d tokens)", cfg.path, len(tokens))
    else:
        if cfg.vocab_size <= len(GOOGLE_SPECIAL_LAYOUT):
            raise ValueError(f"vocab.vocab_size={cfg.vocab_size} leaves no room beside the {len(GOOGLE_SPECIAL_LAYOUT)} special slots")
        files = clean_files(ctx.input("clean").uri)
        log.info("vocab: training WordPiece (target %d) on %d clean files", cfg.vocab_size, len(files))
        import ray

        if ray.is_initialized():
            # Train on a worker, not the driver: the driver may be a small head node.
            tokenizer = Tokenizer.from_str(ray.get(ray.remote(_train_remote).remote(files, cfg)))
        else:
            tokenizer = train_tokenizer(files, cfg)
        tokens = vocab_from_tokenizer(tokenizer)
        data = ("\n".join(tokens) + "\n").encode("utf-8")
        source = "trained"
        raw_inputs = []
        storage.write_text_atomic(storage.join(ctx.output_uri, TOKENIZER_FILE), tokenizer.to_str())
    storage.write_text_atomic(out_vocab, data.decode("utf-8"))
    # Validate what we wrote exactly as downstream stages will read it.
    load_vocab(out_vocab)
    metrics = {
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
    )
