"""What a fine-tuning stage starts from, checked before anything runs and read once: the BERT folder (its
files shipped to the trials through Ray's object store, its tokenizer read by pipeline/formats/tokenizer.py
`load_tokenizer`), and the task's data files."""
from __future__ import annotations

import json
import os
from typing import Any

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.identity import describe_file
from bertpipe.pipeline.framework.stage import StageContext, StageInputError
from bertpipe.pipeline.formats.tokenizer import SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG

MODEL_FILES = ("config.json", "vocab.txt")
# Shipped when the folder has them: the tokenizer's casing (pipeline/formats/tokenizer.py `folder_lowercase`).
OPTIONAL_FILES = (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
BERT_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def require_file(uri: str, key: str, what: str) -> None:
    """StageInputError naming the config key and the path when the file is unset or absent."""
    if not uri:
        raise StageInputError(f"{key} is not set: name a {what} (--set {key}=PATH)")
    if not storage.is_file(uri):
        raise StageInputError(f"{key} {uri}: {what} does not exist")


def check_train_eval(ctx: StageContext, section: str, what: str) -> None:
    """A one-task stage's train_file and eval_file exist, and an explicit init is a BERT folder."""
    cfg = ctx.config[section]
    require_file(cfg.train_file, f"{section}.train_file", f"{what} training file")
    require_file(cfg.eval_file, f"{section}.eval_file", f"{what} evaluation file")
    check_init(ctx, section)


def init_uri(ctx: StageContext, init: str = "") -> str:
    """The BERT to start from: the stage's explicit pretrain input (the workflow makes `<section>.init` one), else
    `init` (a stage called directly), else the pre-training export."""
    pretrain = ctx.input("pretrain")
    return pretrain.uri if pretrain.explicit else (init or ctx.paths.pretrain_export)


def check_init(ctx: StageContext, section: str) -> None:
    """An explicit init must be a Hugging Face-layout BERT folder (checked before anything runs)."""
    if ctx.input("pretrain").explicit:
        check_checkpoint(ctx.input("pretrain").uri, f"{section}.init")


def check_checkpoint(uri: str, key: str) -> None:
    """StageInputError naming `key` unless `uri` is a Hugging Face-layout BERT folder: config.json of a BERT,
    vocab.txt, weights."""
    if not storage.is_file(storage.join(uri, "config.json")):
        what = "does not exist" if not storage.exists(uri) else "has no config.json"
        raise StageInputError(f"{key} {uri} {what}: expected a BERT checkpoint folder "
                              "(config.json, vocab.txt, model.safetensors or pytorch_model.bin)")
    try:
        config = json.loads(storage.read_bytes(storage.join(uri, "config.json")))
    except ValueError as exc:
        raise StageInputError(f"{key} {uri}/config.json is not JSON: {exc}") from None
    lacking = [k for k in BERT_CONFIG_KEYS if k not in config]
    if lacking or config.get("model_type", "bert") != "bert":
        raise StageInputError(f"{key} {uri} is not a BERT checkpoint (model_type "
                              f"{config.get('model_type')!r}, config.json lacks {lacking})")
    if not storage.is_file(storage.join(uri, "vocab.txt")):
        raise StageInputError(f"{key} {uri} has no vocab.txt")
    if not any(storage.is_file(storage.join(uri, w)) for w in WEIGHT_FILES):
        raise StageInputError(f"{key} {uri} has no weights ({' or '.join(WEIGHT_FILES)})")


def read_model_files(uri: str) -> dict[str, bytes]:
    """config.json, vocab.txt, the tokenizer's files where present and the weights of a HF-layout folder, as bytes
    (shipped to trials by Ray)."""
    files = {}
    for name in MODEL_FILES:
        try:
            files[name] = storage.read_bytes(storage.join(uri, name))
        except Exception as e:  # noqa: BLE001 - not-found types differ per store
            raise StageInputError(f"{storage.join(uri, name)}: cannot read the initial model "
                                  f"({type(e).__name__}: {e})") from None
    for name in OPTIONAL_FILES:
        if storage.is_file(storage.join(uri, name)):
            files[name] = storage.read_bytes(storage.join(uri, name))
    for name in WEIGHT_FILES:
        if storage.is_file(storage.join(uri, name)):
            files[name] = storage.read_bytes(storage.join(uri, name))
            return files
    raise StageInputError(f"{uri}: no {' or '.join(WEIGHT_FILES)} in the initial model folder")


def write_model_files(files: dict[str, bytes], directory: str) -> str:
    """The model files as a local folder (where a trial or an actor loads them from); returns it."""
    for name, blob in files.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(blob)
    return directory


def file_checksums(uris: list[str], what: str) -> list[dict[str, Any]]:
    """Size + checksum of each distinct file (they enter the stage's fingerprint and manifest)."""
    return [describe_file(u, what) for u in dict.fromkeys(u for u in uris if u) if storage.is_file(u)]
