"""The vocabulary format: a vocab.txt (one token per line, id = line number) as the pairs stage, pre-training and
fine-tuning read it, checked for the special tokens and duplicates, and its identity (sha256 of the bytes) that
shards and checkpoints are checked against.

The vocab stage (pipeline/stages/vocab.py) writes such a file, trained or copied; everything that only reads one
imports this module, never the stage that trains it.
"""
from __future__ import annotations

import hashlib

from tokenizers import Tokenizer

from bertpipe.pipeline.formats.tokenizer import SPECIAL_TOKENS, bert_tokenizer
from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.stage import StageInputError

VOCAB_FILE = "vocab.txt"
TOKENIZER_FILE = "tokenizer.json"


def vocab_file(uri: str) -> str:
    """A vocab.txt URI from either the file itself or the vocab stage's output folder."""
    return uri if uri.endswith(".txt") else storage.join(uri, VOCAB_FILE)


def read_vocab_bytes(uri: str) -> bytes:
    """The bytes of a vocab.txt (local or a URI); StageInputError when it cannot be read."""
    fs, path = storage.resolve(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except (FileNotFoundError, OSError) as exc:
        raise StageInputError(f"cannot read vocabulary {uri}: {exc}") from exc


def vocab_hash(path_or_uri: str) -> str:
    """sha256 of the vocab.txt bytes: the identity shards and checkpoints are checked against."""
    return hashlib.sha256(read_vocab_bytes(vocab_file(path_or_uri))).hexdigest()


def load_vocab(path: str) -> list[str]:
    """The tokens of a vocab.txt (one per line, id = line number), checked for the special tokens and duplicates."""
    uri = vocab_file(path)
    try:
        text = read_vocab_bytes(uri).decode("utf-8")
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
        raise StageInputError(f"vocabulary {uri} lacks the special tokens {missing} "
                              f"(needs all of {list(SPECIAL_TOKENS)})")
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


def make_tokenizer(vocab_path: str, lowercase: bool) -> Tokenizer:
    """The project's BERT tokenizer (pipeline/formats/tokenizer.py) over a (validated) vocab.txt, local or a URI."""
    return bert_tokenizer(load_vocab(vocab_path), lowercase)
