"""MLflow for a workflow run: one parent run, one nested run per stage, manifests as artifacts.

Everything goes through an explicit `MlflowClient(tracking_uri)` (never the fluent global state), so the same
coordinates can be handed to Ray workers, which log into the stage's run themselves.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from bertpipe.jobs.configtools import to_dict

MAX_PARAM_CHARS = 6000  # MLflow's limit for one param value


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
    else:
        text = json.dumps(data) if isinstance(data, (list, tuple)) else str(data)
        out[prefix[:-1]] = text[:MAX_PARAM_CHARS]
    return out


class WorkflowTracker:
    """Parent run + nested stage runs. A tracker with an empty URI does nothing (tracking off)."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_root: str | None = None):
        self.tracking_uri = tracking_uri
        self.client = None
        self.experiment_id = ""
        self.parent_run_id = ""
        if not tracking_uri:
            return
        import mlflow

        self.client = mlflow.MlflowClient(tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            # A SQLite store has no artifact root of its own: keep artifacts beside the database, not in ./mlruns.
            location = None
            if artifact_root and tracking_uri.startswith("sqlite:"):
                location = "file://" + os.path.abspath(artifact_root)
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        else:
            self.experiment_id = exp.experiment_id

    @property
    def enabled(self) -> bool:
        return self.client is not None

    def start_parent(self, run_name: str, config: dict[str, Any], tags: dict[str, str]) -> None:
        if not self.enabled:
            return
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags={"bertpipe.kind": "workflow", **tags})
        self.parent_run_id = run.info.run_id
        self.log_params(self.parent_run_id, flatten(config))
        self.log_dict_artifact(self.parent_run_id, config, "resolved_config.json")

    def start_stage(self, stage: str, config: dict[str, Any]) -> str:
        if not self.enabled:
            return ""
        run = self.client.create_run(
            self.experiment_id, run_name=stage,
            tags={"mlflow.parentRunId": self.parent_run_id, "bertpipe.kind": "stage", "bertpipe.stage": stage},
        )
        self.log_params(run.info.run_id, flatten(config))
        return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow's batch limit
            self.client.log_batch(run_id, params=items[i:i + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int | None = None) -> None:
        if not self.enabled or not run_id:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i:i + 1000])

    def log_final_metrics(self, run_id: str, metrics: dict[str, float]) -> None:
        """A stage's final figures, except those the stage already logged into its run itself (no duplicates)."""
        if not self.enabled or not run_id:
            return
        logged = self.client.get_run(run_id).data.metrics
        self.log_metrics(run_id, {k: v for k, v in metrics.items() if k not in logged})

    def log_dict_artifact(self, run_id: str, data: Any, name: str) -> None:
        if not self.enabled or not run_id:
            return
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, name)
            with open(path, "w") as f:
                json.dump(to_dict(data), f, indent=2, sort_keys=True)
            self.client.log_artifact(run_id, path)

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        if self.enabled and run_id:
            self.client.set_tag(run_id, key, value)

    def end(self, run_id: str, ok: bool) -> None:
        if self.enabled and run_id:
            self.client.set_terminated(run_id, "FINISHED" if ok else "FAILED")

    def coordinates(self, run_id: str) -> dict[str, str]:
        if not self.enabled:
            return {}
        return {"tracking_uri": self.tracking_uri, "experiment_id": self.experiment_id, "run_id": run_id,
                "parent_run_id": self.parent_run_id}
