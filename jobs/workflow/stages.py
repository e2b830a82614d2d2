"""The stage list: every stage the workflow runs, in order, each declared once. Adding a stage is one entry here and
its code in its own folder (a module with describe_raw_inputs, preflight and run_stage: pipeline/framework/stage.py
StageModule).

Each `code` function imports its stage's module only when the stage is planned or run: stage code pulls in torch,
DeepSpeed and Ray, which `bertpipe --help` and `bertpipe status` must not wait for.
"""
from __future__ import annotations

import logging

from bertpipe.pipeline.framework.stage import Stage, StageModule

log = logging.getLogger("bertpipe")


def _clean() -> StageModule:
    from bertpipe.pipeline.stages import clean
    return clean


def _vocab() -> StageModule:
    from bertpipe.pipeline.stages import vocab
    return vocab


def _pairs() -> StageModule:
    from bertpipe.pipeline.stages import pairs
    return pairs


def _pretrain() -> StageModule:
    from bertpipe.jobs.pretrain import stage
    return stage


def _glue() -> StageModule:
    from bertpipe.jobs.glue import stage
    return stage


def _squad() -> StageModule:
    from bertpipe.jobs.squad import stage
    return stage


def _ner() -> StageModule:
    from bertpipe.jobs.ner import stage
    return stage


def _features() -> StageModule:
    from bertpipe.jobs.features import stage
    return stage


STAGES: tuple[Stage, ...] = (
    Stage("clean", _clean, ("clean",), unit="documents", writes=("docs-*.parquet",)),
    Stage("vocab", _vocab, ("vocab",), ("clean",), explicit=(("clean", "vocab.input"),),
          unneeded_when=(("clean", "vocab.path"),), unit="vocabulary entries", writes=("vocab.txt", "tokenizer.json")),
    Stage("pairs", _pairs, ("pairs", "vocab"), ("clean", "vocab"),
          explicit=(("clean", "pairs.input"), ("vocab", "vocab.path")), unit="instances",
          writes=("seq*/*.parquet", "_parts/seq*/*.arrow", "instances*")),
    # Raw inputs are described from the first section: pretrain.init's files.
    Stage("pretrain", _pretrain, ("pretrain", "model"), ("pairs", "vocab"),
          explicit=(("pairs", "pretrain.input"), ("vocab", "vocab.path")), preflight_reads=("pairs",),
          unit="steps", training=True,
          writes=("deepspeed_config.json", "metrics.json", "history.json", "baselines.json", "curve_*.png",
                  "export/*")),
    # `finetune` was GLUE's alone, while SQuAD and NER fine-tune too.
    Stage("glue", _glue, ("glue",), ("pretrain",), explicit=(("pretrain", "glue.init"),), unit="trials",
          old_names=("finetune",), training=True,
          writes=("models/*", "smoke_glue/*", "submission/*", "submission.zip", "summary.*", "_trials/*")),
    Stage("squad", _squad, ("squad",), ("pretrain",), explicit=(("pretrain", "squad.init"),),
          unit="eval questions", training=True, opt_in=True),
    Stage("ner", _ner, ("ner",), ("pretrain",), explicit=(("pretrain", "ner.init"),), unit="eval sentences",
          training=True, opt_in=True),
    Stage("features", _features, ("features",), ("pretrain",), explicit=(("pretrain", "features.init"),),
          unit="sentences", opt_in=True),
)


def stage_names() -> tuple[str, ...]:
    return tuple(s.name for s in STAGES)


def renamed() -> dict[str, str]:
    """{old name: current name} of every stage that was renamed."""
    return {old: s.name for s in STAGES for old in s.old_names}


def current_stage_names(names: list[str]) -> list[str]:
    """`names` with every renamed stage under its current name, a warning for each."""
    renames = renamed()
    for name in names:
        if name in renames:
            log.warning("stage %s is now %s: running %s (the old name will go; write %s)", name, renames[name],
                        renames[name], renames[name])
    return [renames.get(name, name) for name in names]


def select(only: list[str] | None, start: str | None) -> list[str]:
    """The stages a run runs, in order: `only` those, or from `start` on (opt-in stages only when named), or the
    default workflow (every stage that is not opt-in). ValueError on an unknown name."""
    names = stage_names()
    only = current_stage_names(only) if only else only
    start = current_stage_names([start])[0] if start else start
    for name in list(only or []) + ([start] if start else []):
        if name not in names:
            raise ValueError(f"unknown stage {name!r}; stages are {', '.join(names)}")
    if only and start:
        raise ValueError("--only and --from cannot be combined")
    if only:
        return [n for n in names if n in only]
    if start:
        return [s.name for s in STAGES[names.index(start):] if s.name == start or not s.opt_in]
    return [s.name for s in STAGES if not s.opt_in]
