"""MLflow as a user reads it (real SQLite stores, no mock of MLflow): the experiment says what its runs are, two
workflow runs never show the same name, a pre-training run's charts come in the convention's sections (held-out
accuracy and the loss first), throughput is never measured over a phase's start, and params are rounded."""
from __future__ import annotations


import pytest

import engine_helpers as eh
from bertpipe.jobs.services import tracking
from bertpipe.jobs.pretrain import loop
from bertpipe.jobs.pretrain.checkpointing.resume import Position
from bertpipe.jobs.pretrain.config import PhaseConfig, PretrainConfig

# How MLflow's UI (3.x, the run page and the experiment's charts) lays a run's metrics out: sections named by the
# part before the last "/", in alphabetical order, the names without "/" after them, "system/" in its own tab;
# charts in alphabetical order within a section.
UNSECTIONED = "~"  # sorts after every section name


def ui_order(names) -> list[str]:
    model = [n for n in names if not n.startswith(tracking.SYSTEM)]
    return sorted(model, key=lambda n: (n.rsplit("/", 1)[0] if "/" in n else UNSECTIONED, n))


def _client(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    return uri, mlflow.MlflowClient(uri)


def test_figure_names_follow_the_convention():
    assert tracking.metric_name("eval_mlm_accuracy") == "eval/mlm_accuracy"
    assert tracking.metric_name("loss") == "train/loss"
    assert tracking.metric_name("lr") == "train/optimizer/lr"
    assert tracking.metric_name("data_wait_fraction") == "train/throughput/data_wait_fraction"
    names = tracking.metric_names({"loss": 1, "grad_norm": 1, "sequences_per_second": 1, "eval_nsp_accuracy": 1,
                                   "eval_mlm_accuracy": 1, "mlm_accuracy": 1, "summary_figure": 1})
    assert ui_order(names)[:2] == ["eval/mlm_accuracy", "eval/nsp_accuracy"]
    assert ui_order(names)[2] == "train/loss"  # the training section starts with the loss


def test_params_and_tags_are_rounded():
    flat = tracking.flatten({"pretrain": {"threshold": 0.06369426751592357, "lr": 1e-4, "steps": 40,
                                          "fraction": 0.9, "name": "tiny", "lrs": [1e-4, 5e-5]}})
    assert flat == {"pretrain.threshold": "0.0636943", "pretrain.lr": "0.0001", "pretrain.steps": "40",
                    "pretrain.fraction": "0.9", "pretrain.name": "tiny", "pretrain.lrs": "[0.0001, 5e-05]"}


def test_experiment_is_described_and_workflow_runs_are_numbered(tmp_path):
    uri, client = _client(tmp_path)
    names = []
    for config in ("tiny", "tiny", "mini", "tiny"):
        run = tracking.start_workflow_run(uri, "bertpipe", "", {"seed": 1}, {"bertpipe.config": config},
                                          artifact_root=str(tmp_path / "artifacts"))
        names.append(client.get_run(run.run_id).info.run_name)
        run.end(True)
    assert [n.split(" · ")[0] for n in names] == ["tiny #1", "tiny #2", "mini #1", "tiny #3"]
    # The runs table shows about 17 characters of a name: two runs of one config differ within them.
    assert len({n[:8] for n in names}) == 4
    exp = client.get_experiment_by_name("bertpipe")
    assert exp.tags["mlflow.note.content"] == tracking.EXPERIMENT_DESCRIPTION
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    # MLflow's Markdown breaks a line wherever the text does: one line per paragraph or list item.
    lines = tracking.EXPERIMENT_DESCRIPTION.splitlines()
    assert all(i == 0 or not lines[i - 1] or line.startswith("* ") for i, line in enumerate(lines) if line), lines
    note = client.get_run(run.run_id).data.tags["mlflow.note.content"]
    assert note.startswith("`bertpipe run` with the config **tiny**") and "\n" not in note.strip()

    # An older description of the project's own is brought up to date.
    client.set_experiment_tag(exp.experiment_id, "mlflow.note.content", "**bertpipe**: an older text")
    tracking.start_workflow_run(uri, "bertpipe", "", {"seed": 1}, {"bertpipe.config": "tiny"}).end(True)
    assert client.get_experiment_by_name("bertpipe").tags["mlflow.note.content"] == tracking.EXPERIMENT_DESCRIPTION

    # A description of the user's own is kept; a name given in the config is used as it is.
    client.set_experiment_tag(exp.experiment_id, "mlflow.note.content", "my notes")
    named = tracking.start_workflow_run(uri, "bertpipe", "ablation A", {"seed": 1}, {"bertpipe.config": "tiny"})
    assert client.get_run(named.run_id).info.run_name == "ablation A"
    assert client.get_experiment_by_name("bertpipe").tags["mlflow.note.content"] == "my notes"


def _two_phases() -> PretrainConfig:
    return PretrainConfig(num_workers=1, max_steps=10, phase1_fraction=0.6, log_every_steps=2,
                          checkpoint_every_steps=10**6, eval_every_steps=0, zero_stage=1, length_bin_window=1,
                          phases=(PhaseConfig(max_seq_length=32, max_predictions_per_seq=5, global_batch_size=8,
                                              micro_batch_size=4, learning_rate=1e-3, warmup_steps=2),
                                  PhaseConfig(max_seq_length=64, max_predictions_per_seq=10, global_batch_size=8,
                                              micro_batch_size=4, learning_rate=1e-3, warmup_steps=0)))


def test_a_phase_start_is_not_logged_as_throughput(tmp_path):
    """Two phases (6 steps at seq 32, 4 at seq 64), a window every 2 steps, driven as run_phase drives them (a
    meter per phase) with the worker's real RunLogger on SQLite: the first window of each phase (data start-up,
    first step, the phase switch) logs the training figures and no throughput."""
    uri, client = _client(tmp_path)
    exp = client.create_experiment("names", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(exp).info.run_id
    cfg = _two_phases()
    with eh.process_group():
        w = eh.worker(cfg)
        w.metrics.run = tracking.RunLogger({"tracking_uri": uri, "run_id": run_id, "experiment_id": exp})
        position, carried = Position(), []
        for index, (phase, steps) in enumerate(zip(cfg.phases, cfg.phase_steps())):
            loop.start_phase(w, index)
            position = Position(position.step, index)  # as run_phase starts a phase
            batches = eh.raw_batches(steps * 2, phase.micro_batch_size, phase.max_seq_length, seed=index)
            position = loop.run_epoch(w, position, position.step + steps, batches)
            carried.append(dict(w.metrics.last_window))

    def steps(name):
        return [m.step for m in client.get_metric_history(run_id, name)]

    assert steps("train/loss") == [2, 4, 6, 8, 10]
    assert steps("train/seq_length") == [2, 4, 6, 8, 10]
    for name in ("sequences_per_second", "tokens_per_second", "data_wait_fraction"):
        assert steps(tracking.THROUGHPUT + name) == [4, 6, 10], name  # not 2 (start), not 8 (the switch to 64)
    assert steps(tracking.THROUGHPUT + "padding_fraction") == [2, 4, 6, 8, 10]  # not a matter of time
    # What the loop carries on (the progress line, the stage's final figures) is a steady window's speed.
    speeds = [m.value for m in client.get_metric_history(run_id, tracking.THROUGHPUT + "sequences_per_second")]
    assert [c["sequences_per_second"] for c in carried] == pytest.approx([speeds[1], speeds[2]])
    logged = set(client.get_run(run_id).data.metrics)
    assert ui_order(logged)[0] == "train/loss"  # no evaluation in this run: the loss is the first chart
    assert not [n for n in logged if "/" not in n], logged  # every series is in a section
