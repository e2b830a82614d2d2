"""Keys and (de)serialisation of the trials a fan-out stage keeps when the run fails (pipeline/framework/parts.py).

A kept trial is reused only under the same key: a hash of everything its result depends on (the recipe without
the fields that only say which trials exist or how many run at once, the workflow seed, the task, the learning
rate and seed, and the checksums of the data and of the initial model's files). The stage's own fingerprint is
not the key: it covers every task's files, so fixing MRPC's bad row would throw away SST-2's finished trials.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, TypeVar

from bertpipe.jobs.services.configtools import stable_hash, to_dict
from bertpipe.pipeline.framework import parts
from bertpipe.pipeline.framework.stage import SCHEMA_VERSION

_T = TypeVar("_T")
# Recipe fields that choose the grid, where the data or model come from (their checksums are in the key), or how
# many trials run at once: none changes what one trial computes.
NOT_IN_KEY = ("tasks", "learning_rates", "seeds", "max_concurrent_trials", "glue_data_dir", "init", "train_file",
              "eval_file")


def files_digest(files: dict[str, bytes]) -> str:
    """sha256 over the initial model's files (names and bytes), as the trials received them."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return digest.hexdigest()


def base_key(stage: str, recipe: Any, workflow_seed: int, model_digest: str, data_files: list[dict], **more) -> dict:
    """What every trial of one task shares in its key. `data_files`: {size, checksum} of each file read."""
    return {"stage": stage, "schema_version": SCHEMA_VERSION, "seed": workflow_seed, "model": model_digest,
            "recipe": {k: v for k, v in to_dict(recipe).items() if k not in NOT_IN_KEY},
            "data": [[f.get("size"), f.get("checksum")] for f in data_files], **more}


def trial_key(base: dict, learning_rate: float, sweep_seed: int) -> str:
    return stable_hash({**base, "learning_rate": learning_rate, "sweep_seed": sweep_seed})


def save(stage_uri: str, part: str, key: str, result: Any) -> None:
    """Commit a finished trial: its result dataclass as JSON, after the files it wrote into its part folder."""
    parts.commit(stage_uri, part, key, to_dict(result))


def restore(stage_uri: str, part: str, key: str, cls: type[_T]) -> _T | None:
    """The kept result of a trial with this key, or None (none kept, another key, a file gone, another shape)."""
    data = parts.load_committed(stage_uri, part, key)
    names = {f.name for f in dataclasses.fields(cls)}
    if data is None or set(data) != names:
        return None
    return cls(**data)
