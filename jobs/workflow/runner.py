"""Running the workflow: the selected stages in order, each skipped when its committed manifest matches its
fingerprint, each in a nested MLflow run of the workflow's run; a failed stage cleans up after itself."""
from __future__ import annotations

import gc
import json
import logging
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

from bertpipe.jobs import console_lines, run_record
from bertpipe.jobs.config import RootConfig, config_as_dict, resolved_tracking_uri
from bertpipe.jobs.services.code_version import code_version, git_tags
from bertpipe.jobs.services.configtools import to_dict
from bertpipe.jobs.services.interrupts import interrupt_text, reinstall as reinstall_interrupts
from bertpipe.jobs.services.tracking import RunLogger, start_workflow_run
from bertpipe.jobs.workflow.planning import StagePlan, context, folder_state, preflight, stage_config, stage_uri
from bertpipe.jobs.workflow.stages import select
from bertpipe.jobs.workflow.status import headline_metrics
from bertpipe.pipeline.framework import outputs, parts, storage
from bertpipe.pipeline.framework.console import Console
from bertpipe.pipeline.framework.paths import WorkdirPaths
from bertpipe.pipeline.framework.redact import mask_data
from bertpipe.pipeline.framework.stage import CONFIG_NAME, StageInput, read_manifest, write_manifest

log = logging.getLogger("bertpipe")


class RunSummary(list):
    """What `run` returns: one row per stage, and the MLflow workflow run it made (`workflow_run`: tracking_uri,
    experiment_id, run_id; empty when tracking is off or before the run is made)."""

    def __init__(self) -> None:
        super().__init__()
        self.workflow_run: dict[str, str] = {}


class StageFailed(RuntimeError):
    """A stage raised while running; carries its name so the CLI can say which stage and how to resume."""

    def __init__(self, stage: str, cause: BaseException):
        super().__init__(f"stage {stage} failed: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.cause = cause


@dataclass
class WorkflowRun:
    """One run of the workflow: what every stage of it shares."""

    cfg: RootConfig
    plans: dict[str, StagePlan]
    parent: RunLogger          # the workflow's MLflow run; each stage's run is its child
    console: Console
    code: dict[str, str]       # the code it runs (git tags), named by every MLflow run and manifest
    registered: str            # the model registry name of the pre-trained model
    force: bool = False        # rerun the selected stages even when fresh
    verbose: bool = False
    ray_joined: str = ""       # how this run came to Ray (jobs/cluster.py RayJoined.how); "" when not its own

    def run_or_skip(self, plan: StagePlan, position: tuple[int, int]) -> dict[str, Any]:
        stage, cfg = plan.stage, self.cfg
        fp = plan.fingerprint(cfg)
        run = self.parent.child(stage.name, {"bertpipe.kind": "stage", "bertpipe.stage": stage.name, **self.code})
        run.log_params({**stage_config(cfg, stage), "seed": cfg.seed})
        current, gone = folder_state(stage_uri(cfg, stage.name))
        if current is not None and current.get("fingerprint") == fp and not self.force and not gone:
            console_lines.stage(self.console, *position, stage.name, f"fresh (fingerprint {fp[:12]}), skipped")
            run.set_tag("bertpipe.skipped", "fresh")
            run.log_metrics({"num_rows": current.get("num_rows", 0), "skipped": 1})
            run.log_dict(current, "_MANIFEST.json")
            run.end(True)
            return {"stage": stage.name, "action": "skipped", "rows": current.get("num_rows"), "unit": stage.unit}
        why = "--force" if self.force else f"broken: {gone[0]}" if gone else "stale: config or inputs changed"
        console_lines.stage(self.console, *position, stage.name,
                            "running" if current is None and not gone else f"rerunning ({why})")
        monitor = run.system_metrics() if stage.training else None
        try:
            with self.console.doing(f"{stage.name}: running"):  # named on the console if the stage goes quiet
                manifest = self.run_stage(plan, fp, run)
        except BaseException as exc:
            self.console.end_quietly()
            if isinstance(exc, KeyboardInterrupt):  # a signal: the run is KILLED, and the CLI says in which stage
                run.kill(f"{interrupt_text(exc)} while stage {stage.name} ran")
                exc.stage = stage.name
                raise
            run.fail(exc, traceback.format_exc())
            if isinstance(exc, Exception):
                raise StageFailed(stage.name, exc) from exc
            raise
        finally:
            if monitor is not None:
                monitor.finish()
            # Ray Train's fit takes SIGINT for its own graceful abort and leaves its handler behind (it then calls
            # sys.exit(0) on Ctrl-C): the next stage gets the run's handler back.
            reinstall_interrupts()
        return {"stage": stage.name, "action": "ran", "rows": manifest["num_rows"], "seconds": manifest["seconds"],
                "unit": stage.unit}

    def run_stage(self, plan: StagePlan, fp: str, run: RunLogger) -> dict[str, Any]:
        from bertpipe.jobs.cluster import ensure_ray

        stage, cfg, console = plan.stage, self.cfg, self.console
        uri = stage_uri(cfg, stage.name)
        started = time.time()
        # Uncommits the folder (its manifest goes first, so a crash never leaves a committed half-output) and
        # deletes only what earlier runs of this stage wrote; anything else there stops the run, nothing deleted.
        # Trials a failed run of the stage finished stay (pipeline/framework/parts.py): the stage reuses those of
        # the same config.
        run_id = outputs.claim(uri, stage.name, not self.force, stage.writes)
        kept = parts.count(uri)
        if kept:
            console.say(f"  {stage.name}: {kept} finished trial(s) kept by a failed run, reused where the config "
                        "matches")
        try:
            address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
            with console.doing(f"{stage.name}: connecting to Ray at {address}" if address else
                               f"{stage.name}: starting a local Ray ({cfg.ray.num_cpus} CPUs)"):
                joined = ensure_ray(cfg.ray.address, cfg.ray.num_cpus, cfg.ray.dashboard, self.verbose)
            if joined is not None:
                self.ray_joined = joined.how
                console_lines.ray_started(console, joined.dashboard_url, joined.address)
            ctx = context(cfg, stage, plan.inputs, run, self.registered, console)
            result = stage.code().run_stage(ctx)
            explicit = [r for ids in plan.explicit_ids.values() for r in ids]
            result.raw_inputs = (result.raw_inputs or plan.raw) + explicit
            # The recorded config (here and in the manifest) is for people to read: no password in an input URI.
            config = mask_data({k: to_dict(v) for k, v in ctx.config.items()})
            outputs.remove_temps(uri)
            storage.write_text_atomic(storage.join(uri, CONFIG_NAME),
                                      json.dumps({"seed": cfg.seed, **config}, indent=2, sort_keys=True))
            manifest = write_manifest(
                uri, stage=stage.name, fingerprint=fp, result=result, config=config,
                inputs={n: (i.manifest["output_id"] if i.manifest else i.uri) for n, i in plan.inputs.items()},
                started=started, code_version=code_version(self.code),
            )
        except BaseException as exc:
            after_failure(uri, run_id, exc, console, self.ray_joined)
            self.ray_joined = ""
            raise
        outputs.release(uri)
        # The stage's summary, one value per figure at step 0 (MLflow draws a bar, not a one-point line): only what
        # the stage did not log into its run itself (no duplicate MLflow points), under its MLflow names.
        logged = run.logged_metric_names()
        summary = result.metrics if result.mlflow_summary is None else result.mlflow_summary
        final = {**summary, "num_rows": manifest["num_rows"], "num_bytes": manifest["num_bytes"],
                 "seconds": manifest["seconds"]}
        run.log_metrics({k: v for k, v in final.items() if k not in logged})
        run.log_dict(manifest, "_MANIFEST.json")
        run.end(True)
        made = console_lines.amount(manifest["num_rows"], stage.unit)
        console.say(f"  {stage.name} done: {made} in {manifest['seconds']:.1f} s")
        return manifest

    def read_committed(self, name: str) -> None:
        """Downstream plans read this stage's fresh manifest (a new output id makes them stale)."""
        for later in self.plans.values():
            if name in later.inputs and not later.inputs[name].explicit:
                uri = stage_uri(self.cfg, name)
                later.inputs[name] = StageInput(name, uri, read_manifest(uri))


def run(cfg: RootConfig, *, only: list[str] | None = None, start: str | None = None, force: bool = False,
        verbose: bool = False, config_name: str = "", plans: dict[str, StagePlan] | None = None,
        console: Console | None = None, summary: RunSummary | None = None) -> RunSummary:
    """Run the selected stages in order; returns one summary row per stage (ran / skipped), and the MLflow
    workflow run (RunSummary.workflow_run).

    `plans`: the result of `preflight` when the caller already ran it (the CLI does, before opening its log).
    `console`: where the run's lines and progress go (the CLI passes its live one); by default one that shows the
    stage lines and no progress.
    `summary`: the caller's, to fill: it names the workflow's MLflow run as soon as there is one, so a caller whose
    run failed finds that run there.
    Raises StageInputError / ValueError from the preflight (nothing started) or StageFailed (a stage raised)."""
    console = console or Console()
    selected = select(only, start)
    plans = plans if plans is not None else preflight(cfg, selected)
    name = config_name or "custom"
    code = git_tags()  # once per run: every run of the workflow and every manifest names the same code
    console.reset()  # the console is this run's again (a failed run before it with this console had quieted it)
    # Runs that an earlier run of this workdir left RUNNING (its driver was killed) become KILLED; this run's own
    # id is recorded until it is closed, for the next run to do the same (jobs/run_record.py).
    with console.doing("mlflow: opening the tracking store (a new SQLite store first creates its tables)"):
        run_record.close_left_running(cfg.workdir, resolved_tracking_uri(cfg),
                                      lambda line: console.error(f"note: {line}"))
        # An empty run name: "<config> #<n> · <date time>" (jobs/services/tracking.py workflow_run_name).
        parent = start_workflow_run(resolved_tracking_uri(cfg), cfg.mlflow.experiment, cfg.mlflow.run_name,
                                    config_as_dict(cfg), {"bertpipe.stages": ",".join(selected),
                                                          "bertpipe.config": name, **code},
                                    artifact_root=WorkdirPaths(cfg.workdir).mlflow_artifacts)
    if parent.active:
        run_record.remember(cfg.workdir, resolved_tracking_uri(cfg), parent.run_id)
    workflow = WorkflowRun(cfg, plans, parent, console, code, cfg.mlflow.registered_model or f"bertpipe-{name}",
                           force, verbose)
    summary = summary if summary is not None else RunSummary()
    summary.workflow_run = dict(parent.coordinates) if parent.active else {}
    outcome = "failed"
    try:
        for k, stage_name in enumerate(selected, 1):
            summary.append(workflow.run_or_skip(plans[stage_name], (k, len(selected))))
            workflow.read_committed(stage_name)
        outcome = "succeeded"
    except KeyboardInterrupt:
        outcome = "killed"  # SIGINT / SIGTERM (jobs/services/interrupts.py): KILLED, not FAILED
        raise
    finally:
        # Best effort: the store may be on the disk whose filling failed the stage. A run not closed stays in the
        # record, and the next run of the workdir closes it.
        if parent.close(outcome, headline_metrics(cfg)) and parent.active:
            run_record.forget(cfg.workdir, parent.run_id)
    return summary


def after_failure(uri: str, run_id: str, exc: BaseException, console: Console, ray_joined: str) -> None:
    """A stage failed or was interrupted: stop its writers first (Ray tasks of this run go on writing otherwise),
    then remove its temporary files (a full disk gets its space back), then record what it left so the next run
    may delete it. Each step best effort: the stage's own error is the one to report."""
    from bertpipe.jobs.cluster import stop_writers

    console.end_quietly()  # what the cleanup meets goes to the log file; the console ends with the CLI's three lines
    # The stage's frames, kept alive by the traceback, hold its Ray Data iterators: dropped now, while Ray is still
    # up, they shut their executors down (cancelling the dataset's tasks) instead of failing later, in __del__,
    # against a Ray that is gone. The traceback keeps its file names and lines for the log.
    traceback.clear_frames(exc.__traceback__)
    gc.collect()
    steps = ((stop_writers, (ray_joined,)), (outputs.remove_temps, (uri,)), (outputs.record_failure, (uri, run_id)))
    for step, args in steps:
        try:
            step(*args)
        except Exception:  # noqa: BLE001
            log.info("after the failure of %s: %s failed", uri, step.__name__, exc_info=True)
