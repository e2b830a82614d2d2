"""MLflow, all of it: the only module of the project that calls MLflow.

Everything goes through an explicit `MlflowClient(tracking_uri)`, never the fluent global state, so the same
coordinates ({tracking_uri, experiment_id, run_id}) can be handed to Ray tasks and Train workers, which log into
their run themselves with a `RunLogger`. A workflow run is one parent run, one nested run per stage; fine-tuning
nests a run per GLUE task and one per trial below its stage run.
"""
from __future__ import annotations

import io
import json
import logging
import math
import os
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

from bertpipe.jobs.configtools import to_dict
from bertpipe.pipeline.redact import mask, mask_data

MAX_PARAM_CHARS = 6000  # MLflow's limit for one param value
PARAM_BATCH, METRIC_BATCH = 100, 1000  # MLflow's log_batch limits


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
    else:
        text = json.dumps(data) if isinstance(data, (list, tuple)) else str(data)
        out[prefix[:-1]] = text[:MAX_PARAM_CHARS]
    return out


def _client(tracking_uri: str):
    import mlflow

    return mlflow.MlflowClient(tracking_uri)


class RunLogger:
    """One MLflow run, from plain coordinates. Inactive (every call a no-op) without a URI and run id, or when
    `enabled` is False (Train ranks other than 0)."""

    def __init__(self, coordinates: dict[str, str] | None, enabled: bool = True):
        self.coordinates = dict(coordinates or {})
        self.run_id = self.coordinates.get("run_id", "")
        active = enabled and bool(self.coordinates.get("tracking_uri")) and bool(self.run_id)
        self.client = _client(self.coordinates["tracking_uri"]) if active else None

    @property
    def active(self) -> bool:
        return self.client is not None

    def child(self, run_name: str, tags: dict[str, str]) -> "RunLogger":
        """A nested run below this one (inactive if this one is)."""
        if not self.active:
            return RunLogger(None)
        run = self.client.create_run(self.coordinates["experiment_id"], run_name=run_name,
                                     tags={"mlflow.parentRunId": self.run_id, **mask_data(tags)})
        return RunLogger({**self.coordinates, "run_id": run.info.run_id, "parent_run_id": self.run_id})

    def log_params(self, params: dict[str, Any], skip_logged: bool = False) -> None:
        if not self.active:
            return
        from mlflow.entities import Param

        flat = mask_data(flatten(to_dict(params)))  # a tracking URI or input URI with a password: masked
        if skip_logged:  # MLflow refuses to change a logged param; the workflow may have logged some already
            logged = self.client.get_run(self.run_id).data.params
            flat = {k: v for k, v in flat.items() if k not in logged}
        items = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(items), PARAM_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + PARAM_BATCH])

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Finite numbers only (NaN/inf and non-numbers are dropped), at `step` (0 when None)."""
        if not self.active:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))]
        for i in range(0, len(items), METRIC_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i:i + METRIC_BATCH])

    def logged_metric_names(self) -> set[str]:
        return set(self.client.get_run(self.run_id).data.metrics) if self.active else set()

    def log_dict(self, data: Any, name: str) -> None:
        self.log_bytes(json.dumps(mask_data(to_dict(data)), indent=2, sort_keys=True).encode(), name)

    def log_bytes(self, blob: bytes, name: str, artifact_path: str | None = None) -> None:
        if not self.active:
            return
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, name)
            with open(path, "wb") as f:
                f.write(blob)
            self.client.log_artifact(self.run_id, path, artifact_path)

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        if self.active:
            self.client.log_artifacts(self.run_id, local_dir, artifact_path)

    def log_torch_model(self, model, registered_name: str) -> str:
        """Log a torch module as an MLflow model of this run and register it under `registered_name`; returns
        the model URI ("" when inactive). The fluent API is the only way MLflow logs models: it is confined here,
        bound to this run and this tracking URI for the duration of the call."""
        if not self.active:
            return ""
        import mlflow
        import mlflow.pytorch

        import torch

        # set_tracking_uri also writes MLFLOW_TRACKING_URI into the environment (inherited by Ray workers
        # started later): put both back exactly as they were.
        previous, env = mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(self.coordinates["tracking_uri"])
        chatter = io.StringIO()  # MLflow prints "Successfully registered model ..." itself: keep it to the log file
        # Its pickle-format caution is for loading untrusted files; ours are our own model, saved by us.
        flavor_log = logging.getLogger("mlflow.pytorch")
        flavor_level = flavor_log.level
        flavor_log.setLevel(logging.ERROR)
        try:
            with mlflow.start_run(run_id=self.run_id), redirect_stdout(chatter), redirect_stderr(chatter):
                # Explicit requirements: inferring them imports and inspects the whole environment (slow).
                info = mlflow.pytorch.log_model(model, name="model", registered_model_name=registered_name,
                                                serialization_format="pickle",
                                                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
        finally:
            flavor_log.setLevel(flavor_level)
            logging.getLogger(__name__).info("mlflow: %s", chatter.getvalue().strip())
            mlflow.set_tracking_uri(previous)
            if env is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = env
        return info.model_uri

    def system_metrics(self):
        """A started monitor of CPU / memory / GPU use logged into this run (`.finish()` it), or None."""
        if not self.active:
            return None
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(self.run_id, sampling_interval=5, tracking_uri=self.coordinates["tracking_uri"])
        monitor.start()
        return monitor

    def fail(self, exc: BaseException, traceback_text: str) -> None:
        """Mark the run FAILED with the error as a tag and the traceback as an artifact."""
        self.set_tag("bertpipe.error", f"{type(exc).__name__}: {exc}"[:5000])
        self.log_bytes(mask(traceback_text).encode(), "traceback.txt")
        self.end(False)

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.set_tag(key, value)

    def set_tag(self, key: str, value: str) -> None:
        if self.active:
            self.client.set_tag(self.run_id, key, mask(str(value)))

    def end(self, ok: bool) -> None:
        if self.active:
            self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def start_workflow_run(tracking_uri: str, experiment: str, run_name: str, config: dict[str, Any],
                       tags: dict[str, str], artifact_root: str | None = None) -> RunLogger:
    """The parent run of a workflow (inactive when tracking_uri is empty: tracking off)."""
    if not tracking_uri:
        return RunLogger(None)
    client = _client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        # A SQLite store has no artifact root of its own: keep artifacts beside the database, not in ./mlruns.
        location = None
        if artifact_root and tracking_uri.startswith("sqlite:"):
            location = "file://" + artifact_root
        experiment_id = client.create_experiment(experiment, artifact_location=location)
    else:
        experiment_id = exp.experiment_id
    run = client.create_run(experiment_id, run_name=run_name, tags={"bertpipe.kind": "workflow", **mask_data(tags)})
    parent = RunLogger({"tracking_uri": tracking_uri, "experiment_id": experiment_id, "run_id": run.info.run_id})
    parent.log_params(config)
    parent.log_dict(config, "resolved_config.json")
    return parent
