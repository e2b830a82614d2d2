"""The Hugging Face file format of BERT weights (what `from_pretrained` reads): `model.safetensors` + `config.json` +
`vocab.txt`; the training checkpoints of pre-training are jobs/pretrain/checkpointing/.

Export writes the parameter names of the matching `transformers` class (BertForPreTraining, BertModel,
BertForSequenceClassification, ...), so `transformers.<Class>.from_pretrained(dir)` loads it with no
missing or unexpected keys. Import reads our exports, Hugging Face BERT folders (safetensors, sharded
safetensors or pytorch_model.bin; with or without heads; BertModel names without the `bert.` prefix;
the old `gamma`/`beta` LayerNorm names) and Google's original TensorFlow variable names given as a dict
of numpy arrays (so TensorFlow is not needed: read the checkpoint with whatever reader you have).

Only three tensors differ between our modules and the Hugging Face names:
- our fused `qkv` linear is the row-wise concatenation of HF's `query`, `key`, `value`;
- the token embedding and the MLM output bias carry vocabulary pad rows, which files never contain.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from bertpipe.model.bert import (BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification,
                        BertForTokenClassification, BertModel)
from bertpipe.model.config import BertConfig

log = logging.getLogger(__name__)

# Our module path → Hugging Face module path, inside BertModel (applied in order, first match wins).
_ENCODER_RENAMES = [
    (r"^embeddings\.norm\.", "embeddings.LayerNorm."),
    (r"^encoder\.layers\.(\d+)\.attention\.out\.", r"encoder.layer.\1.attention.output.dense."),
    (r"^encoder\.layers\.(\d+)\.attention_norm\.", r"encoder.layer.\1.attention.output.LayerNorm."),
    (r"^encoder\.layers\.(\d+)\.ffn\.fc1\.", r"encoder.layer.\1.intermediate.dense."),
    (r"^encoder\.layers\.(\d+)\.ffn\.fc2\.", r"encoder.layer.\1.output.dense."),
    (r"^encoder\.layers\.(\d+)\.ffn_norm\.", r"encoder.layer.\1.output.LayerNorm."),
]
# Heads (outside BertModel): ours → HF.
_HEAD_RENAMES = [
    (r"^mlm\.dense\.", "cls.predictions.transform.dense."),
    (r"^mlm\.norm\.", "cls.predictions.transform.LayerNorm."),
    (r"^mlm\.bias$", "cls.predictions.bias"),
    (r"^nsp\.", "cls.seq_relationship."),
]
_QKV = re.compile(r"^encoder\.layers\.(\d+)\.attention\.qkv\.(weight|bias)$")
_VOCAB_ROWS = {"bert.embeddings.word_embeddings.weight", "embeddings.word_embeddings.weight",
               "cls.predictions.bias"}  # HF names of tensors with one row per vocabulary entry
# HF keys that carry no information of their own: buffers and the tied copies of other tensors.
_IGNORED = re.compile(r"(^|\.)position_ids$|^cls\.predictions\.decoder\.(weight|bias)$")
# Head prefixes of every BERT task in HF naming: present in a file but absent in the model = ignored.
_HEAD_PREFIXES = ("cls.", "classifier.", "qa_outputs.")
# Tensors a file may lack (freshly initialised then) or hold in excess (ignored): task heads and the pooler
# (HF's token-classification and QA models have none).
_OPTIONAL = re.compile(r"^(cls|classifier|qa_outputs)\.|(^|\.)pooler\.")

_ARCHITECTURES = {BertForPreTraining: "BertForPreTraining", BertModel: "BertModel",
                  BertForSequenceClassification: "BertForSequenceClassification",
                  BertForTokenClassification: "BertForTokenClassification",
                  BertForQuestionAnswering: "BertForQuestionAnswering"}


def _unwrap(model: nn.Module) -> nn.Module:
    """The bare model inside DistributedDataParallel (`.module`) or torch.compile (`._orig_mod`)."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = model.module if hasattr(model, "module") else model._orig_mod
    if type(model) not in _ARCHITECTURES:
        raise ValueError(f"not a model of model.bert: {type(model).__name__}")
    return model


def _hf_names(our_name: str, prefix: str) -> list[str]:
    """HF name(s) of one of our state-dict entries (three for a fused qkv tensor)."""
    if m := _QKV.match(our_name.removeprefix("bert.")):
        layer, kind = m.groups()
        return [f"{prefix}encoder.layer.{layer}.attention.self.{p}.{kind}" for p in ("query", "key", "value")]
    if our_name.startswith("bert.") or prefix == "":
        name = our_name.removeprefix("bert.")
        for pattern, repl in _ENCODER_RENAMES:
            name, n = re.subn(pattern, repl, name)
            if n:
                break
        return [prefix + name]
    for pattern, repl in _HEAD_RENAMES:
        name, n = re.subn(pattern, repl, our_name)
        if n:
            return [name]
    return [our_name]  # classifier.*, qa_outputs.*: same names as HF


def _name_map(model: nn.Module) -> dict[str, list[str]]:
    """Our state-dict key → its HF key(s), for every tensor a checkpoint holds (tied copy left out)."""
    prefix = "" if isinstance(model, BertModel) else "bert."
    return {k: _hf_names(k, prefix) for k in model.state_dict() if k != "mlm.decoder_weight"}


def hf_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Our parameters under Hugging Face names (vocabulary pad rows dropped, qkv split), ready for
    `transformers.<Class>.load_state_dict(..., strict=False)` or safetensors. Tensors share storage with
    the model where no split or slice is needed."""
    model = _unwrap(model)
    vocab_size = model.config.vocab_size
    ours = model.state_dict()
    out: dict[str, Tensor] = {}
    for our_name, hf_names in _name_map(model).items():
        tensor = ours[our_name]
        parts = tensor.chunk(3, dim=0) if len(hf_names) == 3 else (tensor,)
        for hf_name, part in zip(hf_names, parts):
            out[hf_name] = part[:vocab_size] if hf_name in _VOCAB_ROWS else part
    return out


def load_hf_state_dict(model: nn.Module, hf: dict[str, Tensor], source: str) -> list[str]:
    """Copy HF-named tensors into `model` (in place). Accepts keys with or without the `bert.` prefix and
    `gamma`/`beta` LayerNorm names. Heads the file lacks keep their fresh init (their names are returned);
    heads of other tasks in the file are ignored. Anything else missing, unexpected or of the wrong
    shape → ValueError naming `source`."""
    model = _unwrap(model)
    config = model.config
    hf = {re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", k)): v
          for k, v in hf.items() if not _IGNORED.search(k)}
    prefix = "" if isinstance(model, BertModel) else "bert."
    has_prefix = any(k.startswith("bert.") for k in hf)
    if prefix and not has_prefix:  # a BertModel file (MiniLM, sentence encoders): encoder names bare
        hf = {(k if k.startswith(_HEAD_PREFIXES) else prefix + k): v for k, v in hf.items()}
    elif not prefix and has_prefix:  # a BertModel wanted from a file with heads: drop the heads
        hf = {k.removeprefix("bert."): v for k, v in hf.items() if k.startswith("bert.")}

    ours = model.state_dict()
    name_map = _name_map(model)
    missing = [h for hs in name_map.values() for h in hs if h not in hf]
    missing_encoder = [h for h in missing if not _OPTIONAL.search(h)]
    wanted = {h for hs in name_map.values() for h in hs}
    unexpected = [k for k in hf if k not in wanted and not _OPTIONAL.search(k)]
    if missing_encoder or unexpected:
        raise ValueError(f"{source}: weights do not match a BERT with {config.num_hidden_layers} layers, "
                         f"hidden size {config.hidden_size}: missing {missing_encoder[:6]}"
                         f"{'...' if len(missing_encoder) > 6 else ''}, unexpected {unexpected[:6]}"
                         f"{'...' if len(unexpected) > 6 else ''}")
    fresh = []
    with torch.no_grad():
        for our_name, hf_names in name_map.items():
            if any(h not in hf for h in hf_names):
                fresh.append(our_name)
                continue
            target = ours[our_name]
            value = torch.cat([torch.as_tensor(hf[h]) for h in hf_names]) if len(hf_names) > 1 \
                else torch.as_tensor(hf[hf_names[0]])
            if hf_names[0] in _VOCAB_ROWS:  # the file has V rows, we have Vp ≥ V; pad rows stay zero
                expected = (config.vocab_size, *target.shape[1:])
                if tuple(value.shape) != expected:
                    raise ValueError(f"{source}: {hf_names[0]} has shape {tuple(value.shape)}, expected "
                                     f"{expected} (vocab_size {config.vocab_size} from config)")
                target.zero_()
                target[: config.vocab_size].copy_(value)
            else:
                if value.shape != target.shape:
                    raise ValueError(f"{source}: {', '.join(hf_names)} has shape {tuple(value.shape)}, "
                                     f"expected {tuple(target.shape)}")
                target.copy_(value)
    if fresh:
        log.info("%s: no weights for %s; they keep their fresh initialisation", source, fresh)
    return fresh


# --------------------------------------------------------------------------------- files


def save_pretrained(model: nn.Module, directory: str | os.PathLike, vocab_path: str | os.PathLike | None,
                    label_names: Sequence[str] | None = None, tokenizer_files: dict[str, str] | None = None) -> None:
    """Write model.safetensors (HF names of the matching transformers class), config.json and, when
    `vocab_path` is given, a copy of it as vocab.txt (its line count must equal config.vocab_size).
    A classifier's config names its labels (`label_names`, one per output; LABEL_<i> without them).
    `tokenizer_files` ({name: text}, pipeline/formats/tokenizer.py `tokenizer_files`: the casing and special tokens that
    AutoTokenizer reads) are written as given. Each file is written to a temporary name and renamed, so a crash
    leaves no half-written file."""
    model = _unwrap(model)
    config: BertConfig = model.config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if vocab_path is not None:
        with open(vocab_path, encoding="utf-8") as f:
            num_lines = sum(1 for _ in f)
        if num_lines != config.vocab_size:
            raise ValueError(f"{vocab_path} has {num_lines} entries but the model's vocab_size is "
                             f"{config.vocab_size}")

    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in hf_state_dict(model).items()}
    hf_config = config.to_hf_dict()
    hf_config["architectures"] = [_ARCHITECTURES[type(model)]]
    if isinstance(model, (BertForSequenceClassification, BertForTokenClassification)):
        names = list(label_names) if label_names else [f"LABEL_{i}" for i in range(model.num_labels)]
        if len(names) != model.num_labels:
            raise ValueError(f"{len(names)} label names for a head of {model.num_labels} outputs: {names}")
        hf_config["id2label"] = {str(i): name for i, name in enumerate(names)}
        hf_config["label2id"] = {name: i for i, name in enumerate(names)}
        if isinstance(model, BertForSequenceClassification):
            hf_config["problem_type"] = ("regression" if model.num_labels == 1
                                         else "single_label_classification")

    def write(name: str, write_to) -> None:
        tmp = directory / f"{name}.tmp"
        write_to(tmp)
        os.replace(tmp, directory / name)

    write("model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    write("config.json", lambda p: p.write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n"))
    if vocab_path is not None and Path(vocab_path).resolve() != (directory / "vocab.txt").resolve():
        write("vocab.txt", lambda p: shutil.copyfile(vocab_path, p))
    for name, text in (tokenizer_files or {}).items():
        write(name, lambda p, text=text: p.write_text(text, encoding="utf-8"))


def _read_weights(directory: Path) -> tuple[dict[str, Tensor], str]:
    """(HF-named tensors, file name for messages) from model.safetensors, a sharded safetensors index or
    pytorch_model.bin."""
    single, index, pt = (directory / n for n in
                         ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"))
    try:
        if single.exists():
            with safe_open(str(single), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, str(single)
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            tensors = {}
            for shard in sorted(set(weight_map.values())):
                with safe_open(str(directory / shard), framework="pt") as f:
                    tensors.update({k: f.get_tensor(k) for k in f.keys()})
            return tensors, str(index)
        if pt.exists():
            return torch.load(pt, map_location="cpu", weights_only=True), str(pt)
    except Exception as e:  # noqa: BLE001 - any reader failure is reported with the file name
        path = next(p for p in (single, index, pt) if p.exists())
        raise ValueError(f"{path}: cannot read weights ({type(e).__name__}: {e})") from e
    raise ValueError(f"{directory}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def load_pretrained(directory: str | os.PathLike, model_cls: type[nn.Module] = BertForPreTraining, *,
                    config_overrides: dict | None = None, **model_kwargs) -> nn.Module:
    """Build `model_cls` from a checkpoint folder (config.json + weights) and return it (CPU, train mode
    as freshly built). Heads the folder lacks are freshly initialised. `config_overrides` replaces
    non-shape fields (dropout, activation_checkpointing); `model_kwargs` go to the constructor (num_labels;
    inferred from the file's id2label when it holds that same head)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    try:
        hf_config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_path}: cannot read the model config ({e})") from e
    config = BertConfig.from_hf_dict(hf_config)
    if config_overrides:
        config = dataclasses.replace(config, **config_overrides)
    if (model_cls in (BertForSequenceClassification, BertForTokenClassification) and "num_labels" not in model_kwargs
            and hf_config.get("architectures") == [_ARCHITECTURES[model_cls]] and "id2label" in hf_config):
        model_kwargs["num_labels"] = len(hf_config["id2label"])
    model = model_cls(config, **model_kwargs)
    tensors, source = _read_weights(directory)
    load_hf_state_dict(model, tensors, source)
    return model


# ------------------------------------------------------------------------- Google TF names

_TF_SKIP = re.compile(r"adam_[mv]$|global_step$|_power$|/Adam|/LAMB|/Momentum")


def tf_name_to_hf(name: str) -> tuple[str, bool]:
    """Google TF variable name → (HF name, needs transpose). E.g.
    `bert/encoder/layer_0/attention/self/query/kernel` → (`bert.encoder.layer.0.attention.self.query.weight`,
    True): TF dense kernels are [in, out], torch Linear weights are [out, in]."""
    name = re.sub(r"layer_(\d+)", r"layer.\1", name).replace("/", ".")
    if name.endswith("_embeddings"):  # embedding tables are bare variables
        return name + ".weight", False
    if name == "cls.predictions.output_bias":
        return "cls.predictions.bias", False
    if name == "cls.seq_relationship.output_weights":  # stored [2, H] and used with transpose_b
        return "cls.seq_relationship.weight", False
    if name == "cls.seq_relationship.output_bias":
        return "cls.seq_relationship.bias", False
    for tf_suffix, hf_suffix, transpose in ((".kernel", ".weight", True), (".gamma", ".weight", False),
                                            (".beta", ".bias", False)):
        if name.endswith(tf_suffix):
            return name.removesuffix(tf_suffix) + hf_suffix, transpose
    return name, False


def load_google_tf_arrays(arrays: dict[str, np.ndarray], config: BertConfig) -> BertForPreTraining:
    """A BertForPreTraining from Google's TF checkpoint variables (name → numpy array, e.g. read with
    `tf.train.load_checkpoint(path)` elsewhere). Optimizer slots and global_step are skipped."""
    hf = {}
    for tf_name, array in arrays.items():
        if _TF_SKIP.search(tf_name):
            continue
        hf_name, transpose = tf_name_to_hf(tf_name)
        array = np.asarray(array, dtype=np.float32)
        hf[hf_name] = torch.from_numpy(np.ascontiguousarray(array.T if transpose else array))
    model = BertForPreTraining(config)
    load_hf_state_dict(model, hf, "Google TF checkpoint arrays")
    return model
