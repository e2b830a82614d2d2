"""Config: YAML presets + `--set` overrides into frozen dataclasses; unknown keys and bad types are named."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from bertpipe.jobs.config import RootConfig, load_config
from bertpipe.jobs.services.configtools import ConfigError, from_dict, stable_hash, to_dict
from bertpipe.pipeline.stages.config import PairsConfig


def test_presets_load_and_every_preset_is_valid():
    presets = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert {"tiny", "bert_large", "bert_large_lamb"} <= set(presets)
    for name in presets:
        cfg = load_config(name)
        assert isinstance(cfg, RootConfig)


def test_override_reaches_nested_field_and_keeps_types():
    cfg = load_config("tiny", ["pairs.dupe_factor=3", "pairs.max_seq_lengths=[64,128]", "seed=7",
                               "clean.input=a.xml.bz2"])
    assert cfg.pairs.dupe_factor == 3
    assert cfg.pairs.max_seq_lengths == (64, 128)
    assert cfg.seed == 7
    assert cfg.clean.input == (os.path.join(os.getcwd(), "a.xml.bz2"),)  # one string: a one-element tuple, absolute


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"pairs\.dupe_factr"):
        load_config("tiny", ["pairs.dupe_factr=3"])
    with pytest.raises(ConfigError, match="nosuchsection"):
        load_config("tiny", ["nosuchsection.x=1"])


def test_bad_type_is_named():
    with pytest.raises(ConfigError, match=r"pairs\.dupe_factor.*integer"):
        load_config("tiny", ["pairs.dupe_factor=lots"])
    with pytest.raises(ConfigError, match=r"pairs\.short_seq_prob.*number"):
        from_dict(PairsConfig, {"short_seq_prob": "often"}, "pairs")


def test_config_is_frozen_and_round_trips():
    cfg = load_config("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]
    again = from_dict(RootConfig, to_dict(cfg))
    assert again == cfg
    assert stable_hash(again) == stable_hash(cfg)


def test_float_from_yaml_scientific_string():
    # YAML 1.1 reads "1e-4" (no dot) as a string; the loader must still accept it for a float field.
    cfg = load_config("tiny", ["pairs.short_seq_prob=1e-1"])
    assert cfg.pairs.short_seq_prob == pytest.approx(0.1)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope"):
        load_config(str(tmp_path / "nope.yaml"))


def test_off_is_a_string_on_the_command_line():
    cfg = load_config("tiny", ["mlflow.tracking_uri=off"])
    assert cfg.mlflow.tracking_uri == "off"
    with pytest.raises(ConfigError, match=r"ray\.dashboard.*true/false"):
        load_config("tiny", ["ray.dashboard=yes"])


def test_the_old_finetune_section_loads_as_glue_with_one_warning_naming_it(tmp_path, caplog):
    """`finetune` (GLUE's section before it was named for what it is) still loads, in a file and in a --set: the
    same config as `glue`, each use warned about in one line that names the new key."""
    new = load_config("tiny", ["glue.tasks=[MRPC]", "glue.num_epochs=1"])
    old_file = tmp_path / "old.yaml"
    old_file.write_text((Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml").read_text()
                        .replace("\nglue:", "\nfinetune:"))
    with caplog.at_level("WARNING", logger="bertpipe.config"):
        old = load_config(str(old_file), ["finetune.tasks=[MRPC]", "finetune.num_epochs=1"])
    assert old == new and old.glue.tasks == ("MRPC",) and old.glue.num_epochs == 1
    warned = [r.getMessage() for r in caplog.records if r.name == "bertpipe.config"]
    assert len(warned) == 3 and all("finetune is now glue" in w and "\n" not in w for w in warned), warned
    both = tmp_path / "both.yaml"
    both.write_text(old_file.read_text() + "glue:\n  num_epochs: 1\n")
    with pytest.raises(ConfigError, match="glue and finetune"):
        load_config(str(both))


def test_the_old_finetune_stage_name_selects_the_glue_stage_with_a_warning(caplog):
    from bertpipe.jobs import workflow

    with caplog.at_level("WARNING", logger="bertpipe"):
        assert workflow.select(["finetune"], None) == workflow.select(["glue"], None) == ["glue"]
        assert workflow.select(None, "finetune") == workflow.select(None, "glue")
    warned = [r.getMessage() for r in caplog.records if "finetune" in r.getMessage()]
    assert len(warned) == 2 and all("stage finetune is now glue" in w for w in warned), warned
