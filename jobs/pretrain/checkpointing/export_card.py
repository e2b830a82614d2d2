"""What makes the pre-training export a folder to push to the Hugging Face Hub as it is: a model card (`README.md`)
and the tokenizer in one file (`tokenizer.json`).

The card says what a Hub user looks for, from what the run recorded: the model's shape (the export's config.json),
the Wikipedia dump(s) by name, size and checksum as the clean stage's manifest holds them (followed from the pairs
shards this run trained on, so a card never names a dump the model did not see), the steps and key settings, the
held-out MLM/NSP accuracies beside their trivial baselines, and the command that made it. GLUE is not in it: the
pretrain stage commits the export (card included, every file checksummed in its manifest) before the glue stage
fine-tunes it, and rewriting the card afterwards would make the committed stage broken. The card says where the
GLUE scores are instead.

`tokenizer.json` is the product's tokenizer itself (pipeline/formats/tokenizer.py `bert_tokenizer`) built on the
export's vocab.txt with the casing its tokenizer_config.json records, so AutoTokenizer gives the pieces and ids
that pre-training saw.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import sys
import tempfile
from typing import Any

from bertpipe.pipeline.formats.tokenizer import TOKENIZER_CONFIG, bert_tokenizer, lowercase_of, read_vocab_file
from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.paths import export_of
from bertpipe.pipeline.framework.redact import mask
from bertpipe.pipeline.framework.stage import StageContext, read_manifest

CARD = "README.md"
TOKENIZER_JSON = "tokenizer.json"
CARD_FILES = (CARD, TOKENIZER_JSON)
# A Wikipedia dump's file name starts with its wiki: enwiki-20240101-..., simplewiki-..., bgwiki-...; wikis whose
# name is no two- or three-letter language code (zh_min_nan...) give the card no language.
_WIKI = re.compile(r"^([a-z]{2,3}|simple)wiki-")
_LANGUAGE_OF_WIKI = {"simple": "en"}


def write(ctx: StageContext, metrics: dict[str, float], run=None) -> list[str]:
    """README.md and tokenizer.json into the stage's export folder (and into the MLflow run's `export` artifacts,
    beside the worker's files); returns their paths relative to the stage folder, for the stage's outputs."""
    export = export_of(ctx.output_uri)
    hf_config = json.loads(storage.read_text(storage.join(export, "config.json")))
    lowercase = lowercase_of(_json_or_none(storage.join(export, TOKENIZER_CONFIG)), hf_config)
    files = {TOKENIZER_JSON: tokenizer_json(storage.read_bytes(storage.join(export, "vocab.txt")), lowercase),
             CARD: card_text(hf_config, lowercase, training_data(ctx), settings(ctx), metrics, command())}
    for name, text in files.items():
        storage.write_bytes(storage.join(export, name), text.encode("utf-8"))
        if run is not None:
            run.log_bytes(text.encode("utf-8"), name, "export")
    return [f"export/{name}" for name in files]


def _json_or_none(uri: str) -> dict | None:
    return json.loads(storage.read_text(uri)) if storage.exists(uri) else None


def tokenizer_json(vocab: bytes, lowercase: bool) -> str:
    """The product's BERT tokenizer over this vocab.txt, serialised as `tokenizers` (and AutoTokenizer) read it."""
    with tempfile.TemporaryDirectory() as tmp:  # read as every other reader of the export reads vocab.txt
        path = os.path.join(tmp, "vocab.txt")
        with open(path, "wb") as f:
            f.write(vocab)
        return bert_tokenizer(read_vocab_file(path), lowercase).to_str(pretty=True) + "\n"


def command(argv: list[str] | None = None) -> str:
    """The command line that made the run, credentials masked; "" when the stage was not started by the bertpipe
    command (a test or a notebook calling it)."""
    argv = sys.argv if argv is None else argv
    if not argv or os.path.basename(argv[0]) != "bertpipe":
        return ""
    return mask(shlex.join(["bertpipe", *argv[1:]]))


def training_data(ctx: StageContext) -> dict[str, Any]:
    """What the model was trained on, followed back through the manifests: pairs (instances, dupe factor) ->
    clean (its raw dumps: name, size, checksum) and the vocabulary. Keys missing where the chain is not recorded
    (shards given as pretrain.input, a clean output since replaced)."""
    pairs = ctx.inputs.get("pairs")
    vocab = ctx.inputs.get("vocab")
    out: dict[str, Any] = {"pairs_given": bool(pairs and pairs.explicit and not pairs.manifest)}
    if pairs and pairs.manifest:
        out["instances"] = pairs.manifest.get("num_rows")
        out["dupe_factor"] = (pairs.manifest.get("config", {}).get("pairs") or {}).get("dupe_factor")
        clean_id = pairs.manifest.get("inputs", {}).get("clean")
        clean = read_manifest(ctx.paths.stage("clean")) if clean_id else None
        if clean and clean.get("output_id") == clean_id:
            out["documents"] = clean.get("num_rows")
            out["dumps"] = [{"name": _name(d.get("uri", "")), "size": d.get("size"), "checksum": d.get("checksum")}
                            for d in clean.get("raw_inputs", [])]
    if vocab and vocab.manifest:
        out["vocab_trained"] = not (vocab.manifest.get("config", {}).get("vocab") or {}).get("path")
    return out


def _name(uri: str) -> str:
    # The file's name, not its path: a public card need not show the machine's folders or bucket layout.
    return uri.rstrip("/").rsplit("/", 1)[-1]


def settings(ctx: StageContext) -> dict[str, Any]:
    """The pre-training settings the card shows, as plain values."""
    cfg = ctx.config["pretrain"]
    steps = cfg.phase_steps()
    phases = [{"seq": p.max_seq_length, "steps": n, "batch": p.global_batch_size, "lr": p.learning_rate,
               "warmup": p.warmup_steps, "max_predictions": p.max_predictions_per_seq}
              for p, n in zip(cfg.phases, steps) if n]
    return {"phases": phases, "lr_schedule": cfg.lr_schedule, "decay_power": cfg.decay_power,
            "optimizer": cfg.optimizer, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps,
            "weight_decay": cfg.weight_decay, "zero_stage": cfg.zero_stage, "workers": cfg.num_workers,
            "device": "GPU" if cfg.use_gpu else "CPU", "precision": cfg.precision,
            "masked_lm_prob": cfg.masked_lm_prob, "whole_word_masking": cfg.whole_word_masking,
            "init": cfg.init, "seed": ctx.seed, "preset": ctx.config["model"].preset}


def encoder_parameters(hf_config: dict) -> int:
    """Parameters of the encoder with its pooler (what BertModel holds; the heads add the MLM transform and NSP),
    from config.json alone: the export's weights need not be read to describe it."""
    h, i, n = hf_config["hidden_size"], hf_config["intermediate_size"], hf_config["num_hidden_layers"]
    v, p, t = hf_config["vocab_size"], hf_config["max_position_embeddings"], hf_config.get("type_vocab_size", 2)
    embeddings = (v + p + t) * h + 2 * h
    layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
    return embeddings + n * layer + h * h + h


def card_text(hf_config: dict, lowercase: bool, data: dict[str, Any], s: dict[str, Any],
              metrics: dict[str, float], made_by: str) -> str:
    """The model card: Hub metadata, then what it is, how to load it, its data, training, held-out figures."""
    language = _language(data.get("dumps") or [])
    front = ["---", "library_name: transformers", "pipeline_tag: fill-mask",
             "tags:", "- bert", "- fill-mask", "- next-sentence-prediction", "- bertpipe"]
    front += [f"language: {language}"] if language else []
    start = f"continued from `{_name(s['init'])}`" if s["init"] else "from random initialisation"
    lines = front + ["---", "", f"# BERT ({s['preset']}), pre-trained with bertpipe", "",
                     "A BERT encoder with its masked-language-model and next-sentence heads (`BertForPreTraining`), "
                     f"pre-trained {start} on the data below by bertpipe's `pretrain` stage. "
                     + ("Uncased: the tokenizer lowercases text and strips accents." if lowercase else
                        "Cased: the tokenizer keeps case and accents."), "",
                     "```python", "from transformers import AutoModelForMaskedLM, AutoTokenizer", "",
                     'tokenizer = AutoTokenizer.from_pretrained("path/or/repo-id")',
                     'model = AutoModelForMaskedLM.from_pretrained("path/or/repo-id")  # or AutoModelForPreTraining',
                     "```", ""]
    lines += _model_section(hf_config, lowercase) + _data_section(data) + _training_section(s)
    lines += _heldout_section(metrics) + _glue_section() + _made_by_section(made_by)
    return "\n".join(lines).rstrip("\n") + "\n"


def _language(dumps: list[dict]) -> str:
    """The Hub's `language` when every dump is of one language's Wikipedia; "" when mixed or not a wiki dump."""
    found = [_WIKI.match(d.get("name") or "") for d in dumps]
    if not found or not all(found):
        return ""
    languages = {_LANGUAGE_OF_WIKI.get(m.group(1), m.group(1)) for m in found}
    return languages.pop() if len(languages) == 1 else ""


def _table(rows: list[tuple[str, str]]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]


def _model_section(c: dict, lowercase: bool) -> list[str]:
    params = encoder_parameters(c)
    return ["## Model", ""] + _table([
        ("layers", str(c["num_hidden_layers"])), ("hidden size", str(c["hidden_size"])),
        ("attention heads", str(c["num_attention_heads"])), ("feed-forward size", str(c["intermediate_size"])),
        ("max positions", str(c["max_position_embeddings"])),
        ("vocabulary", f"{c['vocab_size']:,} WordPiece entries, {'uncased' if lowercase else 'cased'}"),
        ("parameters", f"{params / 1e6:.1f} M (encoder and pooler)" if params >= 1e5 else f"{params:,}")])


def _data_section(d: dict[str, Any]) -> list[str]:
    lines = ["## Training data", ""]
    if d.get("dumps"):
        lines += ["Wikipedia dump(s), as the clean stage recorded them:", "", "| file | bytes | checksum |",
                  "|---|---|---|"]
        lines += [f"| {x['name']} | {x['size']:,} | `{x['checksum']}` |" if isinstance(x.get("size"), int)
                  else f"| {x['name']} | ? | `{x.get('checksum')}` |" for x in d["dumps"]]
        lines.append("")
    elif d.get("pairs_given"):
        lines += ["Pre-training shards given as `pretrain.input`: the text they were made from is not recorded.", ""]
    else:
        lines += ["The dump is not recorded: the clean output the shards were made from is no longer in the "
                  "workdir.", ""]
    facts = []
    if d.get("documents") is not None:
        facts.append(f"{d['documents']:,} articles after cleaning")
    if d.get("instances") is not None:
        dupe = f" (dupe factor {d['dupe_factor']})" if d.get("dupe_factor") else ""
        facts.append(f"{d['instances']:,} sentence-pair instances{dupe}, 50% IsNext / 50% random second segment")
    if "vocab_trained" in d:
        facts.append("the WordPiece vocabulary " + ("trained on the cleaned text" if d["vocab_trained"]
                                                    else "given (vocab.path)"))
    text = "; ".join(facts)
    return lines + ([text[:1].upper() + text[1:] + ".", ""] if facts else [])


def _training_section(s: dict[str, Any]) -> list[str]:
    phases = s["phases"]
    total = sum(p["steps"] for p in phases)
    first = phases[0] if phases else {"lr": 0, "warmup": 0}
    decay = "linear decay" if s["decay_power"] == 1 else f"polynomial decay (power {s['decay_power']:g})"
    schedule = (f"peak {first['lr']:g}, {first['warmup']} warmup steps, {decay} to 0 over the run"
                if s["lr_schedule"] == "run" else
                "each phase warms up and decays on its own: " + ", ".join(
                    f"peak {p['lr']:g} at seq {p['seq']} ({p['warmup']} warmup steps)" for p in phases) + f", {decay}")
    b1, b2 = s["betas"]
    rows = [("steps", f"{total:,}: " + ", then ".join(f"{p['steps']:,} at seq {p['seq']}" for p in phases)),
            ("batch (sequences per step)", ", ".join(f"{p['batch']} at seq {p['seq']}" for p in phases)),
            ("learning rate", schedule),
            ("optimizer", f"{'AdamW' if s['optimizer'] == 'adamw' else 'LAMB'} (betas {b1:g}, {b2:g}, eps "
                          f"{s['eps']:g}, weight decay {s['weight_decay']:g}), DeepSpeed ZeRO stage {s['zero_stage']}"),
            ("masking", f"{s['masked_lm_prob']:.0%} of tokens (80% [MASK], 10% random, 10% kept), at most "
                        + " / ".join(str(p["max_predictions"]) for p in phases) + " per sequence"
                        + (", whole words" if s["whole_word_masking"] else "")),
            ("hardware", f"{s['workers']} {s['device']} worker(s), {_precision(s)}"),
            ("seed", str(s["seed"]))]
    return ["## Training", ""] + _table(rows)


def _precision(s: dict[str, Any]) -> str:
    # "auto" is what the run chose for its device (jobs/pretrain/config.py): bf16 on GPUs, fp32 on CPUs.
    precision = s["precision"] if s["precision"] != "auto" else "bf16" if s["device"] == "GPU" else "fp32"
    return f"{precision} arithmetic"


def _heldout_section(m: dict[str, float]) -> list[str]:
    if "eval_mlm_accuracy" not in m and "eval_nsp_accuracy" not in m:
        return []
    seq = f" at seq {int(m['seq_length'])}" if m.get("seq_length") else ""
    count = f" ({int(m['eval_sequences']):,} sequences)" if m.get("eval_sequences") else ""
    lines = ["## Held-out evaluation", "", f"On the held-out sentence pairs{seq}{count}, after the last step, beside "
             "what a trivial predictor scores (MLM: always the most frequent token; NSP: always the majority "
             "label):", "", "| task | accuracy | trivial baseline |", "|---|---|---|"]
    for task in ("mlm", "nsp"):
        if f"eval_{task}_accuracy" in m:
            base = m.get(f"baseline_{task}_accuracy")
            lines.append(f"| {task.upper()} | {m[f'eval_{task}_accuracy']:.4f} | "
                         f"{'' if base is None else f'{base:.4f}'} |")
    if "eval_mlm_loss" in m:
        lines += ["", f"MLM loss {m['eval_mlm_loss']:.4f}."]
    return lines + [""]


def _glue_section() -> list[str]:
    return ["## GLUE", "",
            "Not in this card. bertpipe's `glue` stage fine-tunes this folder after the pretrain stage has written "
            "and committed it (weights and card together), and reports the dev scores per task, the GLUE average "
            "and the test-set submission in its own output: `glue/summary.md` beside this `pretrain/` folder in the "
            "run's workdir, and the workflow's MLflow run.", ""]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bertpipe")
    except PackageNotFoundError:  # the code of a submitted job's working dir (jobs/submit.py), not installed
        return "(not installed)"


def _made_by_section(made_by: str) -> list[str]:
    lines = ["## How it was made", ""]
    if made_by:
        lines += ["```", made_by, "```", ""]
    return lines + [f"With bertpipe {_version()} (a BERT pre-training pipeline on Ray). The run's full, resolved "
                    "configuration is `pretrain/_CONFIG.json` in its workdir, and every stage's inputs and outputs "
                    "are in its `_MANIFEST.json`.", ""]
