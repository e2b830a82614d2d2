"""Watching a run as a user does: the console of `make run` (conftest's shared `made_run`: short, stage headers,
progress, summary, no repeated warning), the dashboard it prints answering while the run goes, and MLflow read
back through its client afterwards (headline metrics and tags on the workflow run, a registered model that loads,
final evaluations at the last step; slow: a failed stage marked FAILED with its error and traceback)."""
from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def watched(made_run):
    """conftest's shared `make run` (the tiny preset, tracking on)."""
    return made_run


def _steps() -> int:
    from bertpipe.jobs.config import load_config

    return load_config("tiny").pretrain.max_steps


def test_console_is_short_and_says_what_runs(watched):
    assert watched["rc"] == 0, "\n".join(watched["stderr"][-30:])
    everything = watched["stdout"] + watched["stderr"]
    assert len(everything) <= 100, "\n".join(everything)
    for k, stage in enumerate(["clean", "vocab", "pairs", "pretrain", "glue"], 1):
        assert any(line.startswith(f"[stage {k}/5] {stage}: running") for line in watched["stdout"])
    steps = _steps()
    assert any(re.match(rf"  pretrain: \d+/{steps} \(\d+%\) steps · loss [\d.]+", line) for line in watched["stdout"])
    assert any(re.match(r"  glue: (\d+)/\1 \(100%\) steps · trials (\d+)/\2 · best [\d.]+", line)
               for line in watched["stdout"]), "\n".join(watched["stdout"])
    assert any(re.fullmatch(r"stage +status +output +time", line) for line in watched["stdout"])
    assert any(line.startswith("GLUE score") for line in watched["stdout"])
    repeated = [line for line, n in collections.Counter(everything).items() if n > 1 and "WARN" in line.upper()]
    assert not repeated, repeated


def test_printed_dashboard_answers_during_the_run(watched):
    assert watched["dashboard"] in (200, 401), watched["dashboard"]


def _client(workdir: Path):
    import mlflow

    return mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")


def _workflow_runs(client) -> list:
    exp = client.get_experiment_by_name("bertpipe")
    runs = client.search_runs([exp.experiment_id], max_results=200)
    return [r for r in runs if r.data.tags.get("bertpipe.kind") == "workflow"]


def test_mlflow_workflow_run_carries_headline_metrics_and_code_version(watched):
    client = _client(watched["workdir"])
    (parent,) = _workflow_runs(client)
    assert parent.info.status == "FINISHED" and parent.data.tags["bertpipe.status"] == "succeeded"
    assert parent.data.tags["bertpipe.config"] == "tiny"
    assert re.fullmatch(r"tiny #1 · \d{4}-\d\d-\d\d \d\d:\d\d", parent.info.run_name), parent.info.run_name
    assert "workflow run" in client.get_experiment_by_name("bertpipe").tags["mlflow.note.content"]
    assert parent.data.tags["mlflow.note.content"].startswith("`bertpipe run` with the config **tiny**")
    assert re.fullmatch(r"[0-9a-f]{7,}", parent.data.tags["bertpipe.git_commit"])
    assert parent.data.tags["bertpipe.git_dirty"] in ("true", "false")
    metrics = parent.data.metrics
    for key in ("pretrain/loss", "pretrain/eval_mlm_accuracy", "pretrain/eval_nsp_accuracy", "glue/MRPC",
                "glue/score"):
        assert key in metrics, sorted(metrics)
    # One scale: GLUE's percent (the report's convention) reaches MLflow as fractions, as the accuracies do.
    assert all(0.0 <= metrics[k] <= 1.0 for k in metrics if "accuracy" in k or k.startswith("glue/")), metrics


def test_pretrained_model_is_registered_and_loads(watched):
    """Registered as code + weights (tests/test_registered_model.py has the details): loads through pyfunc."""
    import mlflow.pyfunc
    import pandas as pd

    client = _client(watched["workdir"])
    versions = client.search_model_versions("name='bertpipe-tiny'")
    assert len(versions) == 1
    pairs_id = json.loads((watched["workdir"] / "pairs" / "_MANIFEST.json").read_text())["output_id"]
    assert versions[0].tags["config"] == "tiny" and versions[0].tags["data"] == pairs_id
    assert re.fullmatch(r"[0-9a-f]{7,}(-dirty)?", versions[0].tags["git_commit"])
    assert versions[0].description.startswith("Held-out MLM accuracy")
    assert "load_model" in client.get_registered_model("bertpipe-tiny").description
    assert client.get_model_version_by_alias("bertpipe-tiny", "newest").version == versions[0].version
    # conftest puts MLflow's tracking URI (and the environment it writes) back after the test.
    mlflow.set_tracking_uri(f"sqlite:///{watched['workdir'] / 'mlflow.db'}")
    model = mlflow.pyfunc.load_model(f"models:/bertpipe-tiny/{versions[0].version}")
    out = model.predict(pd.DataFrame({"input_ids": [[2, 10, 11, 3, 12, 3]]}))
    assert out.shape[0] == 1 and out.shape[1] > 0


def test_final_evaluation_is_logged_at_the_last_step(watched):
    client = _client(watched["workdir"])
    pretrain = [r for r in client.search_runs([client.get_experiment_by_name("bertpipe").experiment_id])
                if r.data.tags.get("bertpipe.stage") == "pretrain"][0]
    history = client.get_metric_history(pretrain.info.run_id, "eval/mlm_accuracy")
    assert max(m.step for m in history) == _steps() and min(m.step for m in history) > 0
    # Nothing of pre-training is a one-point line: a figure without a section is one value at step 0.
    for name in client.get_run(pretrain.info.run_id).data.metrics:
        if "/" not in name:
            assert [m.step for m in client.get_metric_history(pretrain.info.run_id, name)] == [0], name

