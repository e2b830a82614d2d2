"""Every stage's "module:function" reference resolves; a bad one is an error when the stage is defined (module) or
first used (function), never a silent "no raw inputs" that would drop their checksums from the fingerprint."""
from __future__ import annotations

import dataclasses

import pytest

from bertpipe.jobs import workflow
from bertpipe.jobs.config import load_config
from bertpipe.jobs.workflow import STAGES, Stage, StageReferenceError


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_every_reference_of_every_stage_resolves(stage):
    assert stage.run in stage.references
    for ref in stage.references:
        assert callable(workflow._load(ref)), ref


def test_a_missing_module_is_refused_when_the_stage_is_defined():
    for bad in ("bertpipe.pipeline.stages.vocabb:run_stage", "bertpipe.nowhere.vocab:run_stage",
                "bertpipe.pipeline.stages.vocab", "bertpipe.pipeline.stages.vocab:"):
        with pytest.raises(StageReferenceError, match="vocab"):
            Stage("vocab", ("vocab",), (), bad)


def test_a_missing_function_is_an_error_at_first_use_not_no_raw_inputs(tmp_path):
    vocab = next(s for s in STAGES if s.name == "vocab")
    cfg = load_config("tiny", [], str(tmp_path))
    # The module is defined, the function is not.
    typo = dataclasses.replace(vocab, raw_inputs="bertpipe.pipeline.stages.vocab:describe_raw_input")
    with pytest.raises(StageReferenceError, match="has no describe_raw_input"):
        workflow.raw_inputs_of(cfg, typo)
    with pytest.raises(StageReferenceError, match="not a function"):
        workflow._load("bertpipe.pipeline.stages.vocab:VOCAB_FILE")
