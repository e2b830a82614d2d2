"""Where everything of a workflow run lives, derived from one workdir. Built once, on the driver, from the
absolute workdir (or URI) of the loaded config, and handed to every stage and, through them, to every worker:
no stage joins workdir strings itself, so no path can be resolved against a worker's working directory."""
from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass

from bertpipe.pipeline.framework import storage


def export_of(pretrain_uri: str) -> str:
    """Where a pre-training output folder keeps its Hugging Face-layout export: the one spelling of it, for the
    stage that writes it and the stages that read it."""
    return storage.join(pretrain_uri, "export")


@dataclass(frozen=True)
class WorkdirPaths:
    workdir: str

    def __post_init__(self) -> None:
        if not storage.is_remote(self.workdir) and not os.path.isabs(self.workdir):
            raise ValueError(f"workdir {self.workdir!r} must be absolute or a URI (resolve it when loading the config)")

    def _join(self, *parts: str) -> str:
        join = posixpath.join if storage.is_remote(self.workdir) else os.path.join
        return join(self.workdir, *parts)

    def stage(self, name: str) -> str:
        """A stage's output folder: its data files and, last, its _MANIFEST.json."""
        return self._join(name)

    @property
    def pretrain_export(self) -> str:
        """The pre-trained model in Hugging Face layout: what fine-tuning starts from."""
        return export_of(self.stage("pretrain"))

    @property
    def ray_results(self) -> str:
        """Ray Train storage: checkpoints live outside the stage folder, which a rerun empties, so it resumes."""
        return self._join("ray_results")

    @property
    def mlflow_db(self) -> str:
        return self._join("mlflow.db")

    @property
    def mlflow_artifacts(self) -> str:
        return self._join("mlartifacts")

    @property
    def logs(self) -> str:
        return self._join("logs")

    @property
    def lock(self) -> str:
        """Who is writing this workdir (pipeline/framework/workdir_lock.py); hidden, so no listing of outputs sees
        it."""
        return self._join(".bertpipe.lock")
