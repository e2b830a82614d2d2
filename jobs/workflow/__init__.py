"""The workflow: clean -> vocab -> pairs -> pretrain -> glue (and the opt-in squad, ner, features), each stage
skipped when its committed manifest matches its fingerprint.

stages.py    the stage list: each stage declared once
planning.py  inputs, raw inputs, fingerprints and the preflight, before anything starts
status.py    every stage's state (`bertpipe status`) and the headline figures of a workflow run
runner.py    the run loop, one MLflow run per stage, and the clean-up after a failed stage
"""
from bertpipe.jobs.workflow.planning import preflight, raw_inputs_of, stage_uri
from bertpipe.jobs.workflow.runner import RunSummary, StageFailed, run
from bertpipe.jobs.workflow.stages import STAGES, current_stage_names, select
from bertpipe.jobs.workflow.status import headline_metrics, status

__all__ = ["STAGES", "RunSummary", "StageFailed", "current_stage_names", "headline_metrics", "preflight",
           "raw_inputs_of", "run", "select", "stage_uri", "status"]
