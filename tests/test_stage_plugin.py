"""A stage is one declaration in the stage list plus its own code: the workflow knows no stage by name.

The toy stage (tests/toy_stage/stage.py) is added to the list the way a new stage would be, and then planned, run,
skipped, made stale, listed by `bertpipe status` and `--help`, and reached by its old name, with no other change.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest

from bertpipe.jobs.cli import build_parser, main
from bertpipe.jobs.config import RootConfig, load_config
from bertpipe.jobs.glue.config import GlueConfig
from bertpipe.jobs.pretrain.config import PretrainConfig
from bertpipe.jobs.workflow import stages
from bertpipe.jobs.workflow.planning import context
from bertpipe.pipeline.framework.stage import Stage, StageModule, read_manifest

PROTOCOL = [name for name, _ in inspect.getmembers(StageModule, inspect.isfunction) if not name.startswith("_")]


def _toy() -> StageModule:
    from toy_stage import stage
    return stage


TOY = Stage("toy", _toy, ("clean",), unit="lines", old_names=("lines",), opt_in=True, writes=("count.txt",))


def test_the_protocol_is_what_the_workflow_calls():
    assert sorted(PROTOCOL) == ["describe_raw_inputs", "preflight", "run_stage"]


@pytest.mark.parametrize("stage", stages.STAGES, ids=lambda s: s.name)
def test_every_stage_declares_what_the_workflow_needs_and_its_code_provides_the_protocol(stage):
    code = stage.code()
    for name in PROTOCOL:
        assert len(inspect.signature(getattr(code, name)).parameters) == 1, name
    fields = {f.name: f.type for f in dataclasses.fields(RootConfig)}
    earlier = stages.stage_names()[:stages.stage_names().index(stage.name)]
    assert set(stage.sections) | set(stage.preflight_reads) <= set(fields)
    assert set(stage.inputs) <= set(earlier), "a stage reads only the stages before it"
    cfg = RootConfig()
    for upstream, key in (*stage.explicit, *stage.unneeded_when):
        section, _, name = key.partition(".")
        assert upstream in stage.inputs and hasattr(getattr(cfg, section), name), key
    assert stage.unit and not set(stage.old_names) & set(stages.stage_names())


def test_a_stage_reads_its_config_section_typed(tmp_path):
    cfg = load_config("tiny", [], str(tmp_path))
    pretrain = next(s for s in stages.STAGES if s.name == "pretrain")
    ctx = context(cfg, pretrain, {})
    assert ctx.section(PretrainConfig) is cfg.pretrain
    with pytest.raises(TypeError, match="0 config sections of type GlueConfig"):
        ctx.section(GlueConfig)


@pytest.fixture
def with_toy(monkeypatch):
    monkeypatch.setattr(stages, "STAGES", (*stages.STAGES, TOY))


def test_a_new_stage_shows_in_help_and_its_old_name_still_selects_it(with_toy, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    assert "toy" in capsys.readouterr().out
    assert stages.select(["lines"], None) == ["toy"]
    assert stages.select(None, None) == ["clean", "vocab", "pairs", "pretrain", "glue"]  # opt-in: only when named


@pytest.mark.integration
def test_a_new_stage_runs_skips_and_goes_stale_through_the_workflow(with_toy, tmp_path, ray_local, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("one\ntwo\nthree\n")
    workdir = tmp_path / "work"
    args = ["run", "--config", "tiny", "--workdir", str(workdir), "--only", "toy", "--set", f"clean.input={text}",
            "--set", "mlflow.tracking_uri=off"]

    assert main(args) == 0
    manifest = read_manifest(str(workdir / "toy"))
    assert manifest["num_rows"] == 3 and (workdir / "toy" / "count.txt").read_text() == "3\n"
    assert "toy done: 3 lines" in capsys.readouterr().out

    assert main(args) == 0
    assert "fresh (fingerprint" in capsys.readouterr().out

    text.write_text("one\ntwo\nthree\nfour\n")  # a changed raw input: stale by its checksum
    main(["status", "--config", "tiny", "--workdir", str(workdir), "--set", f"clean.input={text}", "--json"])
    rows = {r["stage"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["toy"]["state"] == "stale"
    assert main(args[:6] + ["lines"] + args[7:]) == 0  # by its old name
    assert read_manifest(str(workdir / "toy"))["num_rows"] == 4


def test_the_stage_list_imports_every_stages_code_so_tools_follow_it():
    """No "module:function" strings: the stage list's own imports reach each stage's module (an import graph of
    the workflow shows every stage)."""
    import ast

    source = Path(stages.__file__).read_text()
    imported = {f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
    for stage in stages.STAGES:
        assert stage.code().__name__ in imported, stage.name
