"""A stage that plugs in: the whole of a new stage's code, for tests/test_stage_plugin.py. It counts the lines of
the text files `clean.input` names (it reuses the clean section: a stage with a section of its own also adds the
section's dataclass to RootConfig)."""
from __future__ import annotations

from typing import Any

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.identity import describe_file
from bertpipe.pipeline.framework.stage import StageContext, StageInputError, StageResult
from bertpipe.pipeline.stages.config import CleanConfig


def describe_raw_inputs(cfg: CleanConfig) -> list[dict[str, Any]]:
    return [describe_file(uri) for uri in cfg.input]


def preflight(ctx: StageContext) -> None:
    for uri in ctx.section(CleanConfig).input:
        if not storage.is_file(uri):
            raise StageInputError(f"toy: clean.input {uri} is not a file")


def run_stage(ctx: StageContext) -> StageResult:
    lines = [line for uri in ctx.section(CleanConfig).input for line in storage.read_text(uri).splitlines()]
    storage.write_text_atomic(storage.join(ctx.output_uri, "count.txt"), f"{len(lines)}\n")
    return StageResult(num_rows=len(lines), outputs=["count.txt"])
