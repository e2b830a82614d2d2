"""The stage contract: what a stage gets, what it returns, and the manifest that commits its output.

A stage writes its data files first and `_MANIFEST.json` last: the manifest is the commit point, and a folder
without one is never read as input. The fingerprint hashes the stage's config, the seed, the schema version,
the identity of raw inputs (size + checksum) and the output ids of the upstream manifests it read — so a changed
config field, a different dump, or a rerun of an upstream stage makes this stage and everything after it stale.
"""
from __future__ import annotations

import json
import os
import posixpath
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from bertpipe.pipeline import storage
from bertpipe.pipeline.paths import WorkdirPaths

MANIFEST_NAME = "_MANIFEST.json"
SCHEMA_VERSION = 1


class StageInputError(ValueError):
    """Bad input for a stage (missing file, malformed dump, wrong vocabulary...): a user error, nothing committed."""


class StageOutputError(RuntimeError):
    """A stage finished without writing an output it declares: it is not committed."""


@dataclass(frozen=True)
class StageInput:
    name: str
    uri: str
    # The upstream stage's committed manifest (None until that stage has run, or for an explicit input).
    manifest: dict[str, Any] | None
    # The user named this input (a vocab.txt, a shard folder, a checkpoint...) instead of the upstream output.
    explicit: bool = False


@dataclass
class StageContext:
    """Everything a stage run needs; stages must not read global state."""

    name: str
    output_uri: str
    # Config sections this stage declared (e.g. {"pairs": PairsConfig(...)}).
    config: dict[str, Any]
    seed: int
    inputs: dict[str, StageInput]
    # Logs metrics into this stage's MLflow run: log_metrics({"k": v}, step=None). No-op without tracking.
    log_metrics: Callable[[dict[str, float], int | None], None] = lambda metrics, step=None: None
    # MLflow coordinates so remote workers (Ray Train rank 0) can log into the stage's run themselves.
    tracking: dict[str, str] = field(default_factory=dict)
    # The workdir layout; by default the folder holding output_uri (a stage called on its own, as tests do).
    paths: WorkdirPaths | None = None

    def __post_init__(self) -> None:
        if self.paths is None:
            parent = (posixpath.dirname(self.output_uri.rstrip("/")) if "://" in self.output_uri
                      else os.path.dirname(self.output_uri.rstrip(os.sep)))
            self.paths = WorkdirPaths(parent)

    def input(self, name: str) -> StageInput:
        return self.inputs[name]


@dataclass
class StageResult:
    num_rows: int
    # Extra figures for the manifest and MLflow (throughput, counts...).
    metrics: dict[str, float] = field(default_factory=dict)
    # Raw inputs actually read, each {"uri", "size", "checksum"}; recorded in the manifest.
    raw_inputs: list[dict[str, Any]] = field(default_factory=list)
    # Anything else worth keeping beside the data (e.g. paths of exported models).
    extra: dict[str, Any] = field(default_factory=dict)
    # Paths (relative to the output folder) that downstream stages or users rely on. The manifest is written only
    # if all of them exist; a later check that finds one gone makes the stage broken, never fresh.
    outputs: list[str] = field(default_factory=list)
    # The step its final figures belong to in MLflow (pre-training: the last optimizer step).
    final_step: int | None = None


def manifest_uri(output_uri: str) -> str:
    return storage.join(output_uri, MANIFEST_NAME)


def read_manifest(output_uri: str) -> dict[str, Any] | None:
    """The committed manifest of a stage folder, or None if the folder is incomplete or absent."""
    uri = manifest_uri(output_uri)
    if not storage.exists(uri):
        return None
    try:
        return json.loads(storage.read_text(uri))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # a torn manifest (should not happen with atomic writes) counts as no commit


def write_manifest(
    output_uri: str,
    *,
    stage: str,
    fingerprint: str,
    result: StageResult,
    config: dict[str, Any],
    inputs: dict[str, str],
    started: float,
    code_version: str,
) -> dict[str, Any]:
    files = storage.list_files(output_uri)
    present = {p for p, _ in files}
    missing = [p for p in result.outputs if p not in present]
    if missing:
        raise StageOutputError(f"stage {stage} declares outputs it did not write under {output_uri}: "
                               f"{', '.join(missing)}; nothing committed")
    seconds = time.time() - started
    manifest = {
        "stage": stage,
        "fingerprint": fingerprint,
        "output_id": uuid.uuid4().hex,
        "schema_version": SCHEMA_VERSION,
        "num_rows": int(result.num_rows),
        "num_bytes": int(sum(size for _, size in files)),
        "files": [{"path": p, "size": s} for p, s in files],
        "config": config,
        "inputs": inputs,
        "raw_inputs": result.raw_inputs,
        "metrics": result.metrics,
        "extra": result.extra,
        "outputs": list(result.outputs),
        "started_at": started,
        "finished_at": time.time(),
        "seconds": round(seconds, 3),
        "rows_per_second": round(result.num_rows / seconds, 3) if seconds > 0 else None,
        "code_version": code_version,
    }
    storage.write_text_atomic(manifest_uri(output_uri), json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def missing_outputs(output_uri: str, manifest: dict[str, Any]) -> list[str]:
    """Files a committed manifest lists (its declared outputs and every data file) that are no longer there."""
    present = {p for p, _ in storage.list_files(output_uri)}
    listed = list(manifest.get("outputs", [])) + [f["path"] for f in manifest.get("files", [])]
    return sorted({p for p in listed if p not in present})
