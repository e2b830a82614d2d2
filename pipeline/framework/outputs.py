"""A stage folder against its manifest: is it still what was committed, and what may a rerun of the stage delete.

Fresh means every file the manifest lists is there with its recorded size (with `checksums`, its recorded sha256
too) and no other file is, besides the workflow's bookkeeping (`stage.BOOKKEEPING`). Anything else (a file gone,
resized, changed, or one added) makes the stage broken: the workflow recomputes it rather than trust it.

A rerun deletes only what runs of the stage wrote: the files the previous manifest lists, the files a run that
failed recorded in `_RUN.json`, and writers' temporary files (`storage.TEMP_RE`). Any other file stops the run
before anything is deleted: a user's notes, a copy someone dropped in, another tool's output are never ours to
remove. An empty folder nobody claims is left where it is; folders emptied by the deletions are removed.

The record (`_RUN.json`) is written before the first deletion and lists what the run may delete, so a run that
dies while cleaning up leaves the next one enough to finish; a run that fails rewrites it with every file it left.
It also says, before the run writes anything, what the run will write: the stage's output names (`writes`, glob
patterns over paths relative to the folder, declared with the stage in jobs/workflow/stages.py). A driver killed
outright (SIGKILL, an evicted pod, a node lost) records nothing more, and its files are still its own: the record
outlives the run (only a committed run removes it), and any file that matches its patterns appeared after the run had
checked the folder held nothing foreign, so the next run of the stage deletes it and redoes the work. A file that
matches none of them stops the run as before: a user's notes are never deleted.

Trials that a failed run finished and committed under `_trials/` (pipeline/framework/parts.py) are neither deleted nor
foreign: the next run of the same config reuses them (`--force` drops them).
"""
from __future__ import annotations

import fnmatch
import json
import logging
import os
import posixpath
import socket
import time
import uuid
from typing import Any

from bertpipe.pipeline.framework import parts, storage
from bertpipe.pipeline.framework.stage import BOOKKEEPING, MANIFEST_NAME, RUN_NAME, StageInputError, safe_relative

log = logging.getLogger(__name__)


class ForeignFilesError(StageInputError):
    """A stage folder holds files no run of the stage wrote: the run stops, nothing deleted (a user error)."""


def _path(uri: str, rel: str) -> str:
    return storage.join(uri, *rel.split("/"))


def check(uri: str, manifest: dict[str, Any], *, checksums: bool = False) -> list[str]:
    """What makes a committed folder differ from its (schema-valid) manifest, one short phrase each; [] = fresh."""
    present = dict(storage.list_all(uri)[0])
    listed = {f["path"]: f for f in manifest["files"]}
    problems = []
    for path in sorted(set(listed) | set(manifest["outputs"])):
        entry = listed.get(path)
        if path not in present:
            problems.append(f"{path} missing")
        elif entry is not None and present[path] != entry["size"]:
            problems.append(f"{path} is {present[path]:,} bytes, the manifest says {entry['size']:,}")
        elif checksums and entry is not None and entry.get("sha256") and \
                storage.sha256(_path(uri, path)) != entry["sha256"]:
            problems.append(f"{path} changed (its sha256 is not the recorded one)")
    problems += [f"{p} is not in the manifest" for p in present if p not in listed and p not in BOOKKEEPING]
    return problems


def _listed_paths(uri: str, name: str, *keys: str) -> set[str]:
    """The safe relative paths a bookkeeping file lists under `keys`, read leniently: a manifest that fails its
    schema still says which files its run wrote."""
    try:
        data = json.loads(storage.read_text(storage.join(uri, name)))
    except (OSError, ValueError):
        return set()
    if not isinstance(data, dict):
        return set()
    out = set()
    for key in keys:
        for item in data.get(key) or []:
            path = item.get("path") if isinstance(item, dict) else item
            if safe_relative(path):
                out.add(path.replace("\\", "/"))
    return out


def _announced(uri: str) -> tuple[str, ...]:
    """The output names the record of an unfinished run announced it would write (`writes`), () when none."""
    try:
        record = json.loads(storage.read_text(storage.join(uri, RUN_NAME)))
    except (OSError, ValueError):
        return ()
    writes = record.get("writes") if isinstance(record, dict) else None
    return tuple(w for w in writes or () if isinstance(w, str) and w)


def _survey(uri: str) -> tuple[list[str], list[str]]:
    """(files a rerun may delete, files it must not touch) in the folder, each sorted. Trials a failed run kept
    (pipeline/framework/parts.py) are in neither: the stage reuses or drops them itself."""
    kept = parts.kept_files(uri)
    owned = (_listed_paths(uri, MANIFEST_NAME, "files", "outputs") | _listed_paths(uri, RUN_NAME, "files")
             | set(BOOKKEEPING))
    announced = _announced(uri)
    files = [p for p, _ in storage.list_all(uri)[0] if p not in kept]
    ours = [p for p in files if p in owned or storage.is_temp(p) or matches(p, announced)]
    return ours, [p for p in files if p not in ours]


def matches(path: str, patterns: tuple[str, ...]) -> bool:
    """`path` (relative, posix) is one of the names `patterns` declare (fnmatch: `*` crosses folders)."""
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in patterns)


def refuse_foreign(uri: str, stage: str) -> None:
    """ForeignFilesError naming the first file in `uri` that no run of `stage` wrote (one line for the console)."""
    foreign = _survey(uri)[1]
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise ForeignFilesError(
            f"the {stage} output folder holds {_path(uri, foreign[0])}{more}, which no run of stage {stage} wrote "
            f"(its manifest does not list it): move it out of {uri}; nothing was deleted")


def claim(uri: str, stage: str, keep_parts: bool = True, writes: tuple[str, ...] = ()) -> str:
    """Make `uri` ready for a new run of `stage`: uncommit it and delete what earlier runs of the stage wrote, except
    the trials a failed run kept (unless not `keep_parts`: `--force` recomputes everything). `writes`: the names the
    stage writes (glob patterns), recorded before anything is written so that a killed run's files stay its own.
    Returns the run's id (for `record_failure`). ForeignFilesError, before any deletion, if anything else is there."""
    refuse_foreign(uri, stage)
    if not keep_parts:
        parts.drop_all(uri)  # refuse_foreign passed: everything under _trials/ is a kept trial or listed as ours
    ours = [p for p in _survey(uri)[0] if p != RUN_NAME]
    run_id = uuid.uuid4().hex[:12]
    record = {"run_id": run_id, "stage": stage, "started_at": time.time(), "host": socket.gethostname(),
              "pid": os.getpid(), "files": [p for p in ours if p not in BOOKKEEPING],
              "writes": sorted(set(writes) | set(_announced(uri)))}
    storage.write_text_atomic(storage.join(uri, RUN_NAME), json.dumps(record, indent=2))
    # The manifest goes first: from here until the new one is written the folder reads as uncommitted.
    for rel in sorted(ours, key=lambda p: p != MANIFEST_NAME):
        storage.delete_file(_path(uri, rel))
    _remove_emptied_dirs(uri, ours)
    # Done: the names are free again. A file of the same name appearing now is this run's, not the old one.
    storage.write_text_atomic(storage.join(uri, RUN_NAME), json.dumps({**record, "files": []}, indent=2))
    return run_id


def _remove_emptied_dirs(uri: str, deleted: list[str]) -> None:
    """Remove the sub-folders of deleted files that are now empty, deepest first (never a folder we did not empty)."""
    dirs = {posixpath.dirname(p) for p in deleted}
    for d in list(dirs):
        while d:
            dirs.add(d)
            d = posixpath.dirname(d)
    for d in sorted(dirs - {""}, key=lambda p: -p.count("/")):
        storage.delete_empty_dir(_path(uri, d))


def remove_temps(uri: str) -> None:
    """Before the commit: delete writers' temporary files (a retried task's, a killed writer's) left in `uri`."""
    temps = [p for p, _ in storage.list_all(uri)[0] if storage.is_temp(p)]
    for rel in temps:
        storage.delete_file(_path(uri, rel))
    _remove_emptied_dirs(uri, temps)


def release(uri: str) -> None:
    """After the commit: the run record has served (the manifest now lists what the run wrote)."""
    storage.delete_file(storage.join(uri, RUN_NAME))


def record_failure(uri: str, run_id: str) -> None:
    """A run that failed records every file it left, so the next run may delete them. Best effort (a full disk may
    refuse even this): the next run then names a leftover file instead of deleting it."""
    record_uri = storage.join(uri, RUN_NAME)
    try:
        record = json.loads(storage.read_text(record_uri))
        if not isinstance(record, dict) or record.get("run_id") != run_id:
            return  # not our record: claim() refused before writing one
        kept = parts.kept_files(uri)  # the stage's committed trials: the next run reuses them, never deletes them
        files = [p for p, _ in storage.list_all(uri)[0] if p not in BOOKKEEPING and p not in kept]
        record.update(files=files, failed_at=time.time())
        storage.write_text_atomic(record_uri, json.dumps(record, indent=2))
    except (OSError, ValueError) as exc:
        log.warning("could not record the files a failed run left in %s: %s", uri, exc)
