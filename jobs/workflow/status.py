"""`bertpipe status`: every stage's state, and the headline figures a workflow run is compared by."""
from __future__ import annotations

from typing import Any

from bertpipe.jobs.config import RootConfig
from bertpipe.jobs.workflow import stages as stage_list
from bertpipe.jobs.workflow.planning import (context, explicit_inputs, folder_states, needed_inputs, plan_stage,
                                             stage_uri)
from bertpipe.pipeline.framework import parts
from bertpipe.pipeline.framework.stage import ReportsHeadline, ReportsStart, StageInputError, read_manifest


def status(cfg: RootConfig, verify: bool = False) -> list[dict[str, Any]]:
    """Every stage with its state: fresh (committed, matches), stale (committed, would rerun), broken (its
    manifest is invalid, or a file it lists is gone or resized, or one it does not list is there; with `verify`,
    or a file's checksum changed: reruns), missing. Opt-in stages (squad, ner, features) only once they have a
    manifest: a workflow that never ran them is not missing anything. A stage that records where its runs start
    (pre-training) also says where its latest run started from (`start`)."""
    states = folder_states(cfg, checksums=verify)
    rows, by_stage = [], {}
    for stage in stage_list.STAGES:
        manifest, gone = states[stage.name]
        kept = parts.count(stage_uri(cfg, stage.name))  # trials a failed run finished: the stage is not committed
        if stage.opt_in and manifest is None and not gone and not kept:
            continue
        try:
            plan = plan_stage(cfg, stage, states, set())
            expected, problem = plan.fingerprint(cfg), ""
        except (StageInputError, ValueError, OSError) as exc:
            plan, expected, problem = None, "", str(exc)
        if gone:
            state, problem = "broken", "; ".join(gone[:5]) + (f"; {len(gone) - 5} more" if len(gone) > 5 else "")
        elif manifest is None:
            state = "missing"
            if kept and not problem:
                problem = f"a failed run kept {kept} finished trial(s); `bertpipe run` runs the rest and commits"
        elif manifest.get("fingerprint") != expected or any(
                by_stage.get(n, "fresh") != "fresh" for n in needed_inputs(cfg, stage)
                if n not in explicit_inputs(cfg, stage)):
            state = "stale"
        else:
            state = "fresh"
        by_stage[stage.name] = state
        rows.append({
            "stage": stage.name, "state": state, "output": stage_uri(cfg, stage.name),
            "rows": (manifest or {}).get("num_rows"), "bytes": (manifest or {}).get("num_bytes"),
            "seconds": (manifest or {}).get("seconds"), "finished_at": (manifest or {}).get("finished_at"),
            "fingerprint": expected, **({"problem": problem} if problem else {}),
        })
        code = stage.code()
        if isinstance(code, ReportsStart):
            start = code.latest_start(context(cfg, stage, plan.inputs if plan else {}), manifest)
            if start:
                rows[-1]["start"] = start
    return rows


def headline_metrics(cfg: RootConfig) -> dict[str, float]:
    """What two workflow runs are compared by, from the committed manifests of the stages that report a headline
    (pre-training's final loss and held-out accuracies, GLUE's scores)."""
    out: dict[str, float] = {}
    for stage in stage_list.STAGES:
        code = stage.code()
        if isinstance(code, ReportsHeadline):
            out.update(code.headline_metrics((read_manifest(stage_uri(cfg, stage.name)) or {}).get("metrics", {})))
    return out
