"""The stage contract: what a stage gets, what it returns, and the manifest that commits its output.

A stage writes its data files first and `_MANIFEST.json` last: the manifest is the commit point, and a folder
without one is never read as input. The manifest records the stage's fingerprint, which the workflow computes
and compares before it runs the stage (jobs/workflow/planning.py `fingerprint` says what it covers).
"""
from __future__ import annotations

import json
import os
import posixpath
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.console import Console
from bertpipe.pipeline.framework.paths import WorkdirPaths

MANIFEST_NAME = "_MANIFEST.json"
CONFIG_NAME = "_CONFIG.json"  # the stage's resolved config, written just before the manifest
RUN_NAME = "_RUN.json"  # the run writing the folder and what it may delete (pipeline/framework/outputs.py)
# Files the workflow writes at the top of a stage folder besides the stage's own outputs.
BOOKKEEPING = (MANIFEST_NAME, CONFIG_NAME, RUN_NAME)
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


SectionT = TypeVar("SectionT")


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
    # Logs a text file into the stage's MLflow run as an artifact: log_text(text, file name). No-op without tracking.
    log_text: Callable[[str, str], None] = lambda text, name: None
    # MLflow coordinates so remote workers (Ray Train rank 0) can log into the stage's run themselves.
    tracking: dict[str, str] = field(default_factory=dict)
    # The workdir layout; by default the folder holding output_uri (a stage called on its own, as tests do).
    paths: WorkdirPaths | None = None
    # Seconds a stage short of CPUs/GPUs waits for nodes to join (ray.wait_for_resources_s; placement, not part of
    # the stage's result or fingerprint). 0 = refuse at once.
    wait_for_resources_s: float = 0.0
    # The run's console (the CLI's, live; by default one that shows no progress): progress, statuses, lines.
    console: Console = field(default_factory=Console)
    # CPUs of the local Ray this run starts (ray.num_cpus); 0 when it connects to a cluster, whose size a stage
    # learns from Ray itself. A preflight refuses at once a layout that could never start on the local Ray.
    local_ray_cpus: int = 0

    def __post_init__(self) -> None:
        if self.paths is None:
            parent = (posixpath.dirname(self.output_uri.rstrip("/")) if storage.is_remote(self.output_uri)
                      else os.path.dirname(self.output_uri.rstrip(os.sep)))
            self.paths = WorkdirPaths(parent)

    def input(self, name: str) -> StageInput:
        return self.inputs[name]

    def section(self, kind: type[SectionT]) -> SectionT:
        """The config section of type `kind` this stage declared (`ctx.section(PretrainConfig)`), typed."""
        found = [v for v in self.config.values() if isinstance(v, kind)]
        if len(found) != 1:
            raise TypeError(f"stage {self.name} has {len(found)} config sections of type {kind.__name__} "
                            f"(its sections: {', '.join(self.config) or 'none'})")
        return found[0]


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
    # What the workflow logs into the stage's MLflow run as its summary (one value each, at step 0), when not
    # `metrics` itself: a stage whose MLflow names differ from its manifest's (pre-training) sets it.
    mlflow_summary: dict[str, float] | None = None


class StageModule(Protocol):
    """What the code of a stage provides (pipeline/stages/clean.py, jobs/pretrain/stage.py, ...)."""

    def describe_raw_inputs(self, section: Any) -> list[dict[str, Any]]:
        """The raw inputs named in the stage's first config section, each {"uri", "size", "checksum"} (they
        enter its fingerprint); [] when it reads none."""

    def preflight(self, ctx: StageContext) -> None:
        """Before anything of the run starts: raises StageInputError / ValueError on bad input."""

    def run_stage(self, ctx: StageContext) -> StageResult:
        """Writes the stage's outputs under ctx.output_uri (the workflow writes the manifest)."""


@runtime_checkable
class ReportsHeadline(Protocol):
    """A stage whose results head the workflow's MLflow run (what two workflow runs are compared by)."""

    def headline_metrics(self, manifest_metrics: dict[str, Any]) -> dict[str, float]:
        """{MLflow name: value} from the metrics of the stage's committed manifest."""


@runtime_checkable
class ReportsStart(Protocol):
    """A stage whose `bertpipe status` row also says where its latest run started from (pre-training)."""

    def latest_start(self, ctx: StageContext, manifest: dict[str, Any] | None) -> dict[str, Any] | None:
        """What the stage's latest run resumed or started from, as it recorded it; None when nothing is known."""


@dataclass(frozen=True)
class Stage:
    """A stage as the workflow knows it, declared once in the stage list (jobs/workflow/stages.py): everything the
    workflow needs of it besides its code, which `code` imports only when the stage is planned or run (stage code
    pulls in torch, DeepSpeed, Ray: `bertpipe --help` and `bertpipe status` must not wait for them)."""

    name: str
    code: Callable[[], StageModule]
    sections: tuple[str, ...]      # config sections that define the stage (its fingerprint and MLflow params)
    inputs: tuple[str, ...] = ()   # upstream stages whose committed output it reads
    # upstream stage -> the config field ("section.key") that names that input explicitly instead
    explicit: tuple[tuple[str, str], ...] = ()
    # upstream stage -> a config field that, when set (and the input is not named explicitly), makes the stage read
    # nothing of that upstream: a vocab stage given an existing vocab.txt reads no documents.
    unneeded_when: tuple[tuple[str, str], ...] = ()
    # Config sections its preflight also reads, outside its fingerprint: checks against a stage that runs before
    # it in the same workflow (pre-training's phases against the lengths pairs will write).
    preflight_reads: tuple[str, ...] = ()
    unit: str = "rows"             # what its manifest's num_rows counts, as the console says it ("40 steps")
    old_names: tuple[str, ...] = ()  # names it had: `--only` / `--from` still take them, with a warning
    training: bool = False         # MLflow system metrics (CPU, memory, GPU) are logged while it runs
    # Runs only when named (`--only squad`, `--from squad`): a job the default workflow leaves out because it
    # needs data the user must point at (SQuAD and CoNLL files).
    opt_in: bool = False
    # The names the stage writes in its folder (glob patterns, `*` crossing folders), announced in the run record
    # before it writes: a run killed outright leaves files the next run knows as its own
    # (pipeline/framework/outputs.py). tests/test_crash_resume.py checks them against what real runs write.
    writes: tuple[str, ...] = ()


def manifest_uri(output_uri: str) -> str:
    return storage.join(output_uri, MANIFEST_NAME)


# Field -> the types it may hold. A manifest is trusted only in this shape: other code reads these fields without
# checking them again, and `files` decides what a rerun may delete.
_MANIFEST_FIELDS: dict[str, tuple[type, ...]] = {
    "stage": (str,), "fingerprint": (str,), "output_id": (str,), "schema_version": (int,), "num_rows": (int,),
    "num_bytes": (int,), "files": (list,), "outputs": (list,), "config": (dict,), "inputs": (dict,),
    "raw_inputs": (list,), "metrics": (dict,), "extra": (dict,),
}


def safe_relative(path: Any) -> bool:
    """A path inside the stage folder: relative, no "..", no empty part (a manifest must not reach outside)."""
    if not isinstance(path, str) or not path or path.startswith(("/", "\\")) or storage.is_remote(path):
        return False
    parts = path.replace("\\", "/").split("/")
    return all(p not in ("", ".", "..") for p in parts)


def manifest_problem(manifest: Any) -> str:
    """Why `manifest` (parsed JSON) is not a manifest this code can trust; "" when it is."""
    if not isinstance(manifest, dict):
        return f"is {type(manifest).__name__}, not an object"
    for name, types in _MANIFEST_FIELDS.items():
        value = manifest.get(name)
        if not isinstance(value, types) or isinstance(value, bool):
            found = type(value).__name__ if name in manifest else "absent"
            return f"field {name} is {found}, expected {'/'.join(t.__name__ for t in types)}"
    for i, entry in enumerate(manifest["files"]):
        if not isinstance(entry, dict) or not safe_relative(entry.get("path")):
            return f"files[{i}] has no relative path inside the folder"
        size, digest = entry.get("size"), entry.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"files[{i}].size is not a byte count"
        if digest is not None and not isinstance(digest, str):  # absent in manifests written before checksums
            return f"files[{i}].sha256 is not a string"
    if not all(safe_relative(p) for p in manifest["outputs"]):
        return "outputs holds a path that is not relative to the folder"
    return ""


def manifest_state(output_uri: str) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") for a committed folder; (None, "") when there is no manifest; (None, why) when there is one
    that is not a valid manifest: torn, not JSON, or JSON of another shape (the stage is then broken)."""
    uri = manifest_uri(output_uri)
    if not storage.exists(uri):
        return None, ""
    try:
        manifest = json.loads(storage.read_text(uri))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, f"{MANIFEST_NAME} is not JSON ({exc})"
    problem = manifest_problem(manifest)
    return (None, f"{MANIFEST_NAME} does not match the manifest schema: {problem}") if problem else (manifest, "")


def read_manifest(output_uri: str) -> dict[str, Any] | None:
    """The committed manifest of a stage folder, or None if the folder is incomplete, absent or its manifest
    invalid (a folder without a valid manifest is never read as input)."""
    return manifest_state(output_uri)[0]


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
    files = committed_files(output_uri)
    present = {p for p, _ in files}
    missing = [p for p in result.outputs if p not in present]
    if missing:
        raise StageOutputError(f"stage {stage} declares outputs it did not write under {output_uri}: "
                               f"{', '.join(missing)}; nothing committed")
    # Checksums of what is committed, for `bertpipe status --verify`: one read of the output, in parallel.
    with ThreadPoolExecutor(max_workers=8) as pool:
        digests = list(pool.map(lambda rel: storage.sha256(storage.join(output_uri, *rel.split("/"))),
                                [p for p, _ in files]))
    seconds = time.time() - started
    manifest = {
        "stage": stage,
        "fingerprint": fingerprint,
        "output_id": uuid.uuid4().hex,
        "schema_version": SCHEMA_VERSION,
        "num_rows": int(result.num_rows),
        "num_bytes": int(sum(size for _, size in files)),
        "files": [{"path": p, "size": s, "sha256": d} for (p, s), d in zip(files, digests)],
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


def committed_files(output_uri: str) -> list[tuple[str, int]]:
    """(relative path, size) of every file a manifest written now would list: everything in the folder, hidden
    files included, except the workflow's bookkeeping and writers' temporary files."""
    files, _ = storage.list_all(output_uri)
    return [(p, n) for p, n in files if p not in BOOKKEEPING and not storage.is_temp(p)]
