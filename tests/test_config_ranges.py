"""Every numeric and list field of every config section is range-checked when the config loads.

The fields are enumerated from the dataclasses, so a field added tomorrow is walked too. Each gets values no
run can use (negative counts and rates, nan and inf, a list holding a negative or empty entry, an empty phase
list), plus the upper bounds a generic value cannot know (probabilities above 1, lengths BERT cannot hold).
Each must be refused by the loader with one line naming the field, before anything is written; a representative
subset also through the real `bertpipe` command: exit 2, one line on stderr, the workdir never created.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from bertpipe.jobs.config import RootConfig, load_config
from bertpipe.jobs.services.configtools import ConfigError

BIN = Path(sys.executable).parent

# Bounds a generic out-of-range value does not reach: (override, field the message must name).
UPPER_BOUNDS = [
    ("pairs.short_seq_prob=2", "short_seq_prob"),
    ("pairs.heldout_fraction=1.5", "heldout_fraction"),
    ("pairs.heldout_fraction=1", "heldout_fraction"),
    ("pairs.max_seq_lengths=[3]", "max_seq_lengths"),
    ("pairs.max_seq_lengths=[128,1024]", "max_seq_lengths"),
    ("pairs.max_seq_lengths=[512,128]", "max_seq_lengths"),
    ("pairs.max_seq_lengths=[]", "max_seq_lengths"),
    ("pairs.dupe_factor=0", "dupe_factor"),
    ("pairs.num_shards=0", "num_shards"),
    ("vocab.vocab_size=104", "vocab_size"),
    ("clean.input=[]", "input"),
    ("ray.num_cpus=0", "num_cpus"),
    ("seed=4294967296", "seed"),
    ("glue.learning_rates=[]", "learning_rates"),
    ("glue.seeds=[]", "seeds"),
    ("glue.warmup_proportion=1", "warmup_proportion"),
    ("glue.max_seq_length=513", "max_seq_length"),
    ("glue.max_grad_norm=0", "max_grad_norm"),
    ("squad.max_seq_length=1024", "max_seq_length"),
    ("squad.train_articles=[5,2]", "train_articles"),
    ("ner.entity_types=[]", "entity_types"),
    ("features.max_seq_length=7", "max_seq_length"),  # below MIN_SEQ_LENGTH, the bound of every sequence length
    ("features.entity_types=[]", "entity_types"),
    ("pretrain.masked_lm_prob=1", "masked_lm_prob"),
    ("pretrain.phase1_fraction=1.5", "phase1_fraction"),
    ("pretrain.zero_stage=4", "zero_stage"),
    ("pretrain.phases=[{max_seq_length: 1024}]", "max_seq_length"),
]

# Fields whose checks belong in jobs/pretrain/config.py (owned by the pre-training work) that load does not refuse
# yet, or refuses without naming the field. Strict xfail: the gap stays visible, and an entry must go (the test
# fails as XPASS) as soon as `PretrainConfig.__post_init__` covers it.
PRETRAIN_GAPS: set[str] = set()  # fields jobs/pretrain/config.py does not check yet (strict xfail each)


def _unwrap_optional(annotation):
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _bad_values(annotation) -> list[str]:
    """YAML texts out of range for any field of this type ([] when the type is neither numeric nor a list)."""
    annotation = _unwrap_optional(annotation)
    if annotation is int:
        return ["-1"]
    if annotation is float:
        return ["-1.0", ".nan", ".inf"]
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        if item in (int, float):
            return ["[-1]"]
        if item is str:
            return ["['']"]
        if dataclasses.is_dataclass(item):
            return ["[]"]
    return []


def _cases() -> list[tuple[str, str, str]]:
    """(override, field name the message must hold, case id) for every numeric and list field of every section."""
    cases = []

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            annotation = hints[f.name]
            if dataclasses.is_dataclass(annotation):
                walk(annotation, f"{f.name}.")
                continue
            for value in _bad_values(annotation):
                cases.append((f"{prefix}{f.name}={value}", f.name, f"{prefix}{f.name}"))
            item = typing.get_args(annotation)[0] if typing.get_origin(annotation) is tuple else None
            if item is not None and dataclasses.is_dataclass(item):  # pretrain.phases: each field of one phase
                for sub in dataclasses.fields(item):
                    for value in _bad_values(typing.get_type_hints(item)[sub.name]):
                        cases.append((f"{prefix}{f.name}=[{{{sub.name}: {value}}}]", sub.name,
                                      f"{prefix}{f.name}[].{sub.name}"))

    walk(RootConfig, "")
    return cases


CASES = _cases()


def test_the_walk_reaches_every_section_and_the_fields_named_in_the_issue():
    walked = {case_id for _, _, case_id in CASES}
    hints = typing.get_type_hints(RootConfig)
    sections = {name for name, hint in hints.items() if dataclasses.is_dataclass(hint)}
    assert sections - {"mlflow"} <= {w.split(".")[0] for w in walked}  # mlflow holds strings only
    assert {"pairs.short_seq_prob", "pairs.num_shards", "pairs.heldout_fraction", "pairs.max_seq_lengths",
            "pairs.dupe_factor", "pretrain.phases[].max_seq_length", "seed"} <= walked
    assert len(CASES) > 100


def _params() -> list:
    out = []
    for override, name, case_id in CASES + [(o, n, o.split("=")[0]) for o, n in UPPER_BOUNDS]:
        value = override.split("=", 1)[1]
        # nan and inf are refused for every float field by the loader itself: no gap there.
        gap = case_id in PRETRAIN_GAPS and value not in (".nan", ".inf")
        marks = [pytest.mark.xfail(strict=True, reason="not checked by jobs/pretrain/config.py yet")]
        out.append(pytest.param(override, name, id=f"{case_id}={value}", marks=marks if gap else []))
    return out


@pytest.mark.parametrize("override,name", _params())
def test_out_of_range_value_is_refused_at_load_naming_the_field(tmp_path, override, name):
    workdir = tmp_path / "w"
    with pytest.raises(ConfigError) as info:
        load_config("tiny", [override], str(workdir))
    message = str(info.value)
    assert "\n" not in message and name in message, message
    assert not workdir.exists()


def _bertpipe(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    return subprocess.run([str(BIN / "bertpipe"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


# The issue's examples (each was accepted, or failed late, before) and one of each kind of generic value.
CLI_SUBSET = ["pairs.short_seq_prob=2", "pairs.num_shards=0", "pairs.heldout_fraction=1.5",
              "pairs.max_seq_lengths=[-5]", "pairs.max_seq_lengths=[3]", "pairs.dupe_factor=0",
              "clean.rows_per_file=-1", "glue.weight_decay=.nan", "pretrain.phases=[]"]


@pytest.mark.parametrize("override", CLI_SUBSET)
def test_cli_refuses_out_of_range_value_in_one_line_and_writes_nothing(tmp_path, override):
    proc = _bertpipe(tmp_path, "run", "--workdir", "w", "--set", override)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("bertpipe: error: "), proc.stderr
    assert override.split("=")[0].split(".")[-1] in lines[0]
    assert not (tmp_path / "w").exists() and os.listdir(tmp_path) == []


def test_status_refuses_too(tmp_path):
    proc = _bertpipe(tmp_path, "status", "--workdir", "w", "--json", "--set", "pairs.dupe_factor=0")
    assert proc.returncode == 2 and "pairs.dupe_factor must be >= 1" in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "w").exists()
