"""Checks and reads of a downstream stage's inputs: the data files it names and the BERT it starts from."""
from __future__ import annotations

from typing import Any

from bertpipe.jobs.finetune.stage import check_checkpoint, read_model_files
from bertpipe.pipeline import storage
from bertpipe.pipeline.identity import describe_file
from bertpipe.pipeline.stage import StageContext, StageInputError


def require_file(uri: str, key: str, what: str) -> None:
    """StageInputError naming the config key and the path when the file is unset or absent."""
    if not uri:
        raise StageInputError(f"{key} is not set: name a {what} (--set {key}=PATH)")
    if not storage.is_file(uri):
        raise StageInputError(f"{key} {uri}: {what} does not exist")


def init_uri(ctx: StageContext, section: str) -> str:
    """The BERT to start from: the explicit `<section>.init` (as the pretrain input) or the pre-training export."""
    pretrain = ctx.input("pretrain")
    return pretrain.uri if pretrain.explicit else ctx.paths.pretrain_export


def check_init(ctx: StageContext, section: str) -> None:
    """An explicit init must be a Hugging Face-layout BERT folder (checked before anything runs)."""
    if not ctx.input("pretrain").explicit:
        return
    try:
        check_checkpoint(ctx.input("pretrain").uri)
    except StageInputError as e:
        raise StageInputError(str(e).replace("finetune.init", f"{section}.init", 1)) from None


def model_files(uri: str) -> dict[str, bytes]:
    return read_model_files(uri)


def describe(uris: list[str], what: str) -> list[dict[str, Any]]:
    """Size + checksum of each distinct file (they enter the stage's fingerprint and manifest)."""
    return [describe_file(u, what) for u in dict.fromkeys(u for u in uris if u) if storage.is_file(u)]
