"""The end of a successful `bertpipe run`: the summary table, the GLUE scores in two lines (labelled "smoke sample,
NOT GLUE" when they come from the built-in smoke sample; the full table is summary.md), then where everything is
and what to do next.

Every command printed here works as printed in the shell that ran `bertpipe` (`console_lines.tool`: `.venv/bin/mlflow`
when the project's venv is not on PATH, as after `make run`); every path is one the run wrote (relative to the
current directory when it lies under it).
"""
from __future__ import annotations

import logging
import shlex
from typing import Any

from bertpipe.jobs import console_lines
from bertpipe.jobs.glue.report import SMOKE_LABEL
from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.console import Console
from bertpipe.pipeline.framework.paths import WorkdirPaths
from bertpipe.pipeline.framework.stage import read_manifest

log = logging.getLogger("bertpipe")
UI_PORT = 5000  # `mlflow ui`'s default port


def show(console: Console, cfg, args, selected: list[str], summary: list[dict[str, Any]], config_name: str) -> None:
    console_lines.summary(console, summary)
    paths = WorkdirPaths(cfg.workdir)
    glue = read_manifest(paths.stage("glue")) if "glue" in selected else None
    smoke = bool(glue) and bool(glue.get("extra", {}).get("smoke_sample", not cfg.glue.glue_data_dir))
    console.say()
    for line in glue_lines(cfg, glue, smoke):
        console.say(line)
    for line in where_everything_is(cfg, args, selected, getattr(summary, "workflow_run", {}), config_name, smoke):
        console.say(line)


def glue_lines(cfg, manifest: dict | None, smoke: bool) -> list[str]:
    """Each task's best dev score and the averages, from the fine-tuning manifest."""
    if not manifest:
        return []
    metrics = manifest.get("metrics", {})
    dev = {k[len("dev."):]: v for k, v in metrics.items() if k.startswith("dev.")}
    order = [t for t in cfg.glue.tasks if t in dev] + sorted(t for t in dev if t not in cfg.glue.tasks)
    scores = " · ".join(f"{task} {dev[task]:.1f}" for task in order)
    lines = [f"GLUE dev ({SMOKE_LABEL}): {scores}" if smoke else f"GLUE dev: {scores}"]
    averages = [f"GLUE score {metrics['glue_score']:.2f}" if "glue_score" in metrics else "",
                f"BERT paper average {metrics['bert_paper_average']:.2f}" if "bert_paper_average" in metrics else ""]
    lines.append(" · ".join(a for a in averages if a) + " (every task, metric and trial: summary.md, below)")
    return lines


def _registered(tracking_uri: str, name: str, model_uri: str) -> str:
    """`name version N` of the registered model whose source is `model_uri` ("" when MLflow cannot say)."""
    if not (tracking_uri and name and model_uri):
        return ""
    try:
        from mlflow import MlflowClient

        versions = MlflowClient(tracking_uri).search_model_versions(f"name='{name}'")
        found = [v for v in versions if v.source == model_uri]
        return f"{name} version {found[0].version}" if found else ""
    except Exception:  # noqa: BLE001 - a store that does not answer now: the other lines still help
        log.info("could not read the registered model %s", name, exc_info=True)
        return ""


def mlflow_line(tracking_uri: str, workflow_run: dict[str, str]) -> str:
    """How to see this run in MLflow: the UI command on a local store and the run's URL in it, or the server's URL."""
    if not tracking_uri:
        return "  MLflow   off (set mlflow.tracking_uri to track runs)"
    run_path = (f"#/experiments/{workflow_run['experiment_id']}/runs/{workflow_run['run_id']}"
                if workflow_run.get("run_id") else "")
    if tracking_uri.startswith(("http://", "https://")):
        return f"  MLflow   {tracking_uri.rstrip('/')}/{run_path}"
    if tracking_uri.startswith("sqlite:"):
        command = f"{console_lines.tool('mlflow')} ui --backend-store-uri {tracking_uri} --port {UI_PORT}"
        return f"  MLflow   {command}, then http://127.0.0.1:{UI_PORT}/{run_path}"
    return f"  MLflow   {tracking_uri} (workflow run {workflow_run.get('run_id', '?')})"


def real_glue_command(args) -> str:
    """This run's `bertpipe run` (config, workdir, --set), typed as this shell runs it, on real GLUE data."""
    parts = [console_lines.tool("bertpipe"), "run", "--config", args.config]
    if args.workdir:
        parts += ["--workdir", args.workdir]
    for item in args.overrides:
        if not item.startswith("glue.glue_data_dir="):
            parts += ["--set", item]
    return shlex.join(parts + ["--set", "glue.glue_data_dir=GLUE_DIR"])


def where_everything_is(cfg, args, selected: list[str], workflow_run: dict[str, str], config_name: str,
                        smoke: bool) -> list[str]:
    from bertpipe.jobs.config import resolved_tracking_uri

    paths = WorkdirPaths(cfg.workdir)
    tracking_uri = resolved_tracking_uri(cfg)
    lines = ["Where everything is"]
    pretrain = read_manifest(paths.stage("pretrain")) or {}
    export = pretrain.get("extra", {}).get("export")
    if export:
        registered = _registered(tracking_uri, cfg.mlflow.registered_model or f"bertpipe-{config_name}",
                                 pretrain.get("extra", {}).get("mlflow_model", ""))
        lines.append(f"  model    {console_lines.where(export)}"
                     + (f" · MLflow registered model {registered}" if registered else ""))
    if "glue" in selected and read_manifest(paths.stage("glue")):
        out = paths.stage("glue")
        zipped = storage.join(out, "submission.zip")
        lines.append(f"  GLUE     {console_lines.where(storage.join(out, 'summary.md'))}"
                     + (f" · submission {console_lines.where(zipped)}" if storage.exists(zipped) else "")
                     + (f"  ({SMOKE_LABEL})" if smoke else ""))
    lines.append(mlflow_line(tracking_uri, workflow_run))
    if "glue" in selected:
        lines.append(f"  next     on real GLUE: {real_glue_command(args)}"
                     "  (GLUE_DIR: one folder per task, CoLA/ SST-2/ MRPC/ ... as GLUE's download makes them)")
    return lines
