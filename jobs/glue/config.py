"""Typed config of the `glue` stage (GLUE fan-out): the shared fine-tuning recipe (jobs/tuning/recipe.py)
plus GLUE's data and tasks. Frozen, keyword-only: YAML and `--set` fill it.

Defaults follow the BERT paper's GLUE recipe (section 4.1): batch 32, 3 epochs, learning rate picked on dev
from {5e-5, 4e-5, 3e-5, 2e-5}; warmup 10% and weight decay 0.01 as in google-research/bert run_classifier.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from bertpipe.jobs.tuning.recipe import Recipe
from bertpipe.pipeline.framework.config_fields import path_field


@dataclass(frozen=True, kw_only=True)
class GlueConfig(Recipe):
    SECTION: ClassVar[str] = "glue"

    # Folder holding one sub-folder per task (CoLA/, SST-2/, MNLI/...) in the official GLUE TSV layout; any
    # smart_open URI. Empty: the project's small smoke sample (NOT GLUE), written into the stage output.
    glue_data_dir: str = path_field()
    # Tasks to run. Empty: all nine, whichever are present (the rest are reported absent). Named explicitly:
    # a missing task folder is a failure of that task.
    tasks: tuple[str, ...] = ()
    learning_rates: tuple[float, ...] = (5e-5, 4e-5, 3e-5, 2e-5)
    num_epochs: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        from bertpipe.jobs.glue.tasks import get_task

        for task in self.tasks:
            get_task(task)  # unknown name → ValueError listing the nine
