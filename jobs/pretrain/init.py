"""`pretrain.init`: continued pre-training from an existing BERT in Hugging Face layout (config.json, model.safetensors
or pytorch_model.bin, vocab.txt, optionally tokenizer_config.json), a local folder or a URI every worker can read.
Google's original TensorFlow checkpoints are not read here (that needs TensorFlow): convert one to a Hugging Face
folder first (transformers' `convert_bert_original_tf_checkpoint_to_pytorch`).

- At config load (`apply`, on the driver): the init's vocab.txt becomes vocab.path and its casing vocab.lowercase
  (so the vocab stage copies it and pairs tokenizes with it), and the model's shape is the init's: model.preset
  `from-init` when no preset is named; a named preset of another shape is an error naming both shapes.
- In the stage's preflight (`missing_heads`): the weights' names and shapes, read from the safetensors header, are
  checked against the model and the heads the file lacks are named (one console line when the stage runs).
- On each worker (`load_into`), before DeepSpeed wraps the model: the weights are copied in, through the loading
  path of fine-tuning (jobs/tuning/inputs.py `read_model_files`, model/hf_format.py `load_hf_state_dict`).
"""
from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.stage import StageInputError

KEY = "pretrain.init"
SHAPE_FIELDS = (("hidden_size", "hidden"), ("num_hidden_layers", "layers"), ("num_attention_heads", "heads"),
                ("intermediate_size", "feed-forward"))


def read_config(uri: str) -> dict[str, Any]:
    """The init's config.json, after checking the folder is a BERT checkpoint (StageInputError naming the key)."""
    from bertpipe.jobs.tuning.inputs import check_checkpoint

    check_checkpoint(uri, KEY)
    return json.loads(storage.read_bytes(storage.join(uri, "config.json")))


def lowercase(uri: str, config: dict[str, Any]) -> bool:
    """The init's casing: tokenizer_config.json's do_lower_case, else config.json's, else uncased."""
    from bertpipe.pipeline.formats.tokenizer import TOKENIZER_CONFIG, lowercase_of

    tok = storage.join(uri, TOKENIZER_CONFIG)
    return lowercase_of(json.loads(storage.read_bytes(tok)) if storage.is_file(tok) else None, config)


def describe_shape(bert) -> str:
    return ", ".join(f"{what} {getattr(bert, name)}" for name, what in SHAPE_FIELDS)


def apply(cfg, given: dict[str, Any]):
    """The root config with pretrain.init's vocabulary, casing and shape (`cfg` is unchanged without an init).
    `given`: what the YAML file and the overrides named ({section: {key: value}}), to tell a named value from a
    default. ValueError (one line, naming the keys) when a named vocab.path, vocab.lowercase or model.preset
    disagrees with the init."""
    from bertpipe.jobs.pretrain.config import FROM_INIT
    from bertpipe.model import BertConfig
    from bertpipe.pipeline.formats.vocabulary import load_vocab

    uri = cfg.pretrain.init
    if not uri:
        return cfg
    hf = read_config(uri)
    try:
        shape = BertConfig.from_hf_dict(hf)
    except (TypeError, ValueError) as exc:
        raise StageInputError(f"{KEY} {uri}: {exc}") from None
    vocab_uri = storage.join(uri, "vocab.txt")
    tokens = load_vocab(vocab_uri)
    if len(tokens) != shape.vocab_size:
        raise StageInputError(f"{KEY} {uri}: vocab.txt has {len(tokens)} entries but config.json's vocab_size is "
                              f"{shape.vocab_size}")

    def named(section: str, key: str) -> bool:
        return isinstance(given.get(section), dict) and key in given[section]

    if cfg.vocab.path and cfg.vocab.path != vocab_uri:
        raise ValueError(f"vocab.path {cfg.vocab.path} and {KEY} {uri} name two vocabularies: pre-training from an "
                         f"init uses its vocab.txt; leave vocab.path unset")
    cased = lowercase(uri, hf)
    if named("vocab", "lowercase") and cfg.vocab.lowercase != cased:
        raise ValueError(f"vocab.lowercase {cfg.vocab.lowercase} disagrees with {KEY} {uri}, which is "
                         f"{'uncased' if cased else 'cased'}; leave vocab.lowercase unset")
    preset = cfg.model.preset
    if not named("model", "preset"):
        preset = FROM_INIT
    elif preset != FROM_INIT:
        wanted = BertConfig.preset(preset)
        if any(getattr(wanted, f) != getattr(shape, f) for f, _ in SHAPE_FIELDS):
            raise ValueError(f"model.preset {preset} ({describe_shape(wanted)}) disagrees with {KEY} {uri} "
                             f"({describe_shape(shape)}): set model.preset={FROM_INIT}, or a preset of that shape")
    return dataclasses.replace(cfg, vocab=dataclasses.replace(cfg.vocab, path=vocab_uri, lowercase=cased),
                               model=dataclasses.replace(cfg.model, preset=preset))


def weights_file(uri: str) -> str:
    from bertpipe.jobs.tuning.inputs import WEIGHT_FILES

    for name in WEIGHT_FILES:
        if storage.is_file(storage.join(uri, name)):
            return storage.join(uri, name)
    raise StageInputError(f"{KEY} {uri} has no weights ({' or '.join(WEIGHT_FILES)})")


def _meta_tensors(uri: str) -> dict[str, Any]:
    """The weights file's tensors as meta tensors (names and shapes, no data): a safetensors file's header alone
    (a few KB, whatever the model's size), a pytorch_model.bin read whole."""
    import io

    import torch

    path = weights_file(uri)
    if path.endswith(".safetensors"):
        fs, local = storage.resolve(path)
        with fs.open_input_file(local) as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        return {k: torch.empty(v["shape"], device="meta") for k, v in header.items() if k != "__metadata__"}
    state = torch.load(io.BytesIO(storage.read_bytes(path)), map_location="cpu", weights_only=True)
    return {k: torch.empty(tuple(v.shape), device="meta") for k, v in state.items()}


def missing_heads(uri: str, model_cfg, vocab_size: int) -> list[str]:
    """The init's weights checked against the model pre-training builds (names and shapes: StageInputError naming
    the key), and the Hugging Face names of what they lack (`heads_named`)."""
    import torch

    from bertpipe.jobs.pretrain.config import bert_config
    from bertpipe.model import BertForPreTraining
    from bertpipe.model.hf_format import load_hf_state_dict

    bert = bert_config(model_cfg, vocab_size, read_config(uri))
    with torch.device("meta"):
        model = BertForPreTraining(bert)
    try:
        fresh = load_hf_state_dict(model, _meta_tensors(uri), f"{KEY} {uri}")
    except ValueError as exc:
        raise StageInputError(str(exc)) from None
    return heads_named(model, fresh)


def heads_named(model, fresh: list[str]) -> list[str]:
    """Our parameter names → the Hugging Face names a user knows, a module whose parameters are all fresh as
    `module.*` (at most three levels deep: `cls.predictions.transform.*`)."""
    from bertpipe.model.hf_format import _name_map

    names = _name_map(model)
    hf = [h for ours in fresh for h in names.get(ours, [ours])]
    every = [h for hs in names.values() for h in hs]
    def module(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:3]) if len(parts) > 4 else ".".join(parts[:-1])

    out: list[str] = []
    for name in hf:
        siblings = [h for h in every if module(h) == module(name)]
        label = f"{module(name)}.*" if len(siblings) > 1 and all(h in hf for h in siblings) else name
        if label not in out:
            out.append(label)
    return out


def heads_line(uri: str, heads: list[str]) -> str:
    """The console's line about what the init did not provide."""
    if not heads:
        return f"{KEY}: every weight from {uri}"
    return f"{KEY}: {', '.join(heads)} not in the checkpoint: initialised"


def load_into(model, uri: str) -> list[str]:
    """Copy the init's weights into `model` (a BertForPreTraining of its shape, built but not yet wrapped by
    DeepSpeed); returns the parameters the checkpoint lacked (they keep their initialisation, the same on every rank
    since every rank seeds it alike). Through fine-tuning's loading path: the files are read from the path or URI
    into a local folder, then model/hf_format.py reads them."""
    import tempfile
    from pathlib import Path

    from bertpipe.jobs.tuning.inputs import read_model_files, write_model_files
    from bertpipe.model.hf_format import _read_weights, load_hf_state_dict

    with tempfile.TemporaryDirectory(prefix="pretrain-init-") as tmp:
        folder = write_model_files(read_model_files(uri), tmp)
        tensors, source = _read_weights(Path(folder))
        return load_hf_state_dict(model, tensors, f"{KEY} {uri} ({Path(source).name})")


def describe_raw_inputs(cfg) -> list[dict[str, Any]]:
    """The init's files by size and checksum (the pretrain stage's fingerprint: another init reruns pre-training)."""
    from bertpipe.jobs.tuning.inputs import MODEL_FILES, OPTIONAL_FILES, WEIGHT_FILES, file_checksums

    if not cfg.init:
        return []
    return file_checksums([storage.join(cfg.init, n) for n in (*MODEL_FILES, *OPTIONAL_FILES, *WEIGHT_FILES)], KEY)
