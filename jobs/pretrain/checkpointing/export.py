"""The pre-trained model as fine-tuning reads it: Hugging Face layout (model.safetensors, config.json, vocab.txt and
the tokenizer's files), written once by the workers when training ends. Not a checkpoint: no optimizer state, no
position in the data."""
from __future__ import annotations

import os
import tempfile

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.formats.tokenizer import SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG, tokenizer_files

# What fine-tuning (and transformers' AutoModel / AutoTokenizer) loads.
EXPORT_FILES = ("config.json", "model.safetensors", "vocab.txt", TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)


def data_lowercase(heldout: dict[int, str]) -> bool:
    """The casing the model was trained with: do_lower_case of its shards (the held-out ones, {length: uri}, as
    the pairs stage recorded it); True (uncased) without shards."""
    from bertpipe.pipeline.formats.shards import read_shard_meta

    return bool(read_shard_meta(next(iter(heldout.values()))).get("do_lower_case", True)) if heldout else True


def write_export(engine, vocab_bytes: bytes, export_uri: str, zero_stage: int, rank: int, run, lowercase: bool) -> None:
    """HF-layout export (model.safetensors, config.json, vocab.txt and the tokenizer's files with its casing,
    `lowercase`) to `export_uri` from rank 0, also logged to MLflow. Under ZeRO-3 every rank takes part in
    gathering the full parameters."""
    import deepspeed
    import torch.distributed as dist

    from bertpipe.model import save_pretrained

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None,
                                           enabled=zero_stage == 3):
        if rank == 0:
            with tempfile.TemporaryDirectory() as d:
                vocab_path = os.path.join(d, "vocab-source.txt")
                with open(vocab_path, "wb") as f:
                    f.write(vocab_bytes)
                export_dir = os.path.join(d, "export")
                save_pretrained(engine.module, export_dir, vocab_path, tokenizer_files=tokenizer_files(
                    lowercase, engine.module.config.max_position_embeddings))
                storage.upload_dir(export_dir, export_uri)
                run.log_artifacts(export_dir, "export")
    if dist.is_initialized():
        dist.barrier()
