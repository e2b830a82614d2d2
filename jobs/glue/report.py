"""The outcome of a GLUE sweep: per-task outcomes, the summary table (Markdown + CSV) with the GLUE score and
the BERT paper's average, and the submission files GLUE's server takes."""
from __future__ import annotations

import csv
import io
import zipfile
from dataclasses import dataclass, field
from typing import Any

from bertpipe.jobs.glue.metrics import bert_paper_average, glue_score
from bertpipe.jobs.glue.tasks import TaskSpec
from bertpipe.pipeline.framework import storage


SMOKE_LABEL = "smoke sample, NOT GLUE"


@dataclass
class TaskOutcome:
    spec: TaskSpec
    status: str  # ok | failed | absent
    error: str = ""
    trials: list[Any] = field(default_factory=list)  # its finished trials (jobs/tuning/fanout.Trial)
    trial_errors: list[str] = field(default_factory=list)
    num_train: int = 0
    run: Any = None  # the task's MLflow run (a RunLogger), once it has one

    @property
    def best(self):
        """The trial with the best dev score (the first on ties), or None."""
        return max(self.trials, key=lambda t: t.result.score) if self.trials else None

    @property
    def errors(self) -> str:
        return self.error or "; ".join(self.trial_errors)


def submission_rows(spec: TaskSpec, preds: list) -> list[str]:
    """Predictions as GLUE's server wants them: label strings (0/1 for the binary tasks), STS-B floats in [0, 5]."""
    if spec.is_regression:
        return [f"{min(5.0, max(0.0, float(p))):.3f}" for p in preds]
    return [spec.labels[int(p)] for p in preds]


def write_submission(out_uri: str, outcomes: list[TaskOutcome]) -> list[str]:
    """submission/<name>.tsv per test set of each finished task (its best trial's) + submission.zip; returns the
    file names. MNLI's model also predicts the diagnostic set: AX.tsv."""
    return write_submission_files(out_uri, [(o.spec, o.best.result.outputs["test_predictions"]) for o in outcomes
                                            if o.status == "ok" and o.best is not None])


def write_submission_files(out_uri: str, predictions: list[tuple[TaskSpec, dict]]) -> list[str]:
    """submission/<name>.tsv per test set ({name: [index, predictions]} per task) + submission.zip."""
    files: dict[str, bytes] = {}
    for spec, test_predictions in predictions:
        for name, (index, preds) in test_predictions.items():
            lines = ["index\tprediction"] + [f"{i}\t{p}" for i, p in zip(index, submission_rows(spec, preds))]
            files[f"{name}.tsv"] = ("\n".join(lines) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, blob in sorted(files.items()):
            storage.write_bytes(storage.join(out_uri, "submission", name), blob)
            z.writestr(name, blob)
    if files:
        storage.write_bytes(storage.join(out_uri, "submission.zip"), buf.getvalue())
    return sorted(files)


def _dev(o: TaskOutcome) -> dict[str, dict[str, float]]:
    return o.best.result.outputs["dev_metrics"]


def _fmt(o: TaskOutcome) -> str:
    return " / ".join(f"{100 * v:.1f}" for ms in _dev(o).values() for v in ms.values()) if o.best else ""


def _row(o: TaskOutcome) -> dict[str, str]:
    best = o.best.result if o.best else None
    return {
        "task": o.spec.name, "status": o.status,
        "metrics": "/".join(f"{s}.{m}" if len(o.spec.dev_files) > 1 else m
                            for s, _ in o.spec.dev_files for m in o.spec.metrics),
        "dev": _fmt(o), "score": f"{100 * best.score:.2f}" if best else "",
        "best_lr": f"{best.learning_rate:g}" if best else "", "epoch": f"{best.epoch}" if best else "",
        "trials_ok": f"{len(o.trials)}",
        "trials_failed": f"{len(o.trial_errors)}", "num_train": f"{o.num_train}",
        "test_sets": ",".join(best.outputs["test_predictions"]) if best else "",
        "error": o.errors[:300].replace("\n", " "),
    }


def scores(outcomes: list[TaskOutcome]) -> dict[str, float]:
    """Best dev score per task in percent, plus the GLUE score and the BERT paper average (with completeness)."""
    task_scores = {o.spec.name: o.best.result.score for o in outcomes if o.best}
    glue, complete = glue_score(task_scores)
    paper, _ = bert_paper_average({o.spec.name: _dev(o) for o in outcomes if o.best})
    return {**{f"dev.{k}": 100 * v for k, v in task_scores.items()}, "glue_score": glue,
            "glue_score_complete": float(complete), "bert_paper_average": paper}


PERCENT_FIGURES = ("glue_score", "bert_paper_average")  # besides dev.<task>: the report's figures in percent


def as_fractions(metrics: dict[str, float]) -> dict[str, float]:
    """The report's percent figures (GLUE's convention, kept in the manifest and summary.md) as fractions in [0, 1]:
    MLflow shows every accuracy-like figure on one scale, pre-training's held-out accuracies included."""
    return {k: v / 100 if k.startswith("dev.") or k in PERCENT_FIGURES else v for k, v in metrics.items()}


def summary_table(outcomes: list[TaskOutcome], smoke: bool = False) -> tuple[list[dict[str, Any]], str, str]:
    """(rows, Markdown, CSV) of the sweep: one row per task plus the two averages. `smoke`: the scores come from
    the project's built-in sample, and the table says so first."""
    rows = [_row(o) for o in outcomes]
    task_scores = {o.spec.name: o.best.result.score for o in outcomes if o.best}
    glue, complete = glue_score(task_scores)
    paper, paper_complete = bert_paper_average({o.spec.name: _dev(o) for o in outcomes if o.best})
    cols = list(rows[0]) if rows else ["task"]
    md = [f"**{SMOKE_LABEL}**: these scores come from the project's built-in smoke sample, not from GLUE; set "
          "glue.glue_data_dir to the GLUE folders for real scores.", ""] if smoke else []
    md += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]).replace("|", "\\|") for c in cols) + " |" for r in rows]
    md.append("")
    md.append(f"GLUE score (leaderboard way: mean of 9 task scores, two-metric tasks averaged, MNLI = mean of m/mm): "
              f"{glue:.2f}" + ("" if complete else f" — PARTIAL, {len(task_scores)} of 9 tasks, not comparable"))
    md.append(f"BERT paper average (no WNLI; MNLI-m, MNLI-mm, F1 for MRPC/QQP, Spearman for STS-B): {paper:.2f}"
              + ("" if paper_complete else " — PARTIAL"))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=cols)
    writer.writeheader()
    writer.writerows(rows)
    return rows, "\n".join(md) + "\n", out.getvalue()
