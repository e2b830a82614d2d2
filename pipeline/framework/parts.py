"""Trials a stage finished in a run that then failed, kept so that the next run with the same config redoes only
the rest (a GLUE sweep whose MRPC file had a bad row keeps SST-2's hours of training).

A part is a folder under `<stage>/_trials/`: the trial's files (a fine-tuned model, say), then `_DONE.json` last,
its commit point, holding the key the result is valid for (a hash of everything that decides it: the recipe, the
seed, the data and model checksums), the part's files with their sizes, and the trial's result as JSON (never a
pickle: the folder may be shared). A part without a valid marker is half-written and never read.

Who deletes what: the workflow's cleanup (pipeline/framework/outputs.py) neither deletes committed parts nor calls them
foreign files, so they outlive the failed run. The stage itself drops the parts it no longer asks for (another
config) and deletes `_trials/` once its committed outputs are built from them: a committed stage folder never holds
one, and a folder with parts has no manifest, so `status` never calls it fresh. Anything under `_trials/` that no
marker lists was written by the current run (the cleanup removed or refused everything else before it started),
so the stage may delete a failed trial's half-written folder whole.
"""
from __future__ import annotations

import json
import posixpath
import time
from typing import Any

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.stage import safe_relative

TRIALS_DIR = "_trials"
MARKER = "_DONE.json"


def _uri(stage_uri: str, rel: str) -> str:
    return storage.join(stage_uri, *rel.split("/"))


def _markers(stage_uri: str) -> dict[str, dict[str, Any]]:
    """{part (path relative to the stage folder): marker} for every marker that parses as an object."""
    out = {}
    for rel, _ in storage.list_all(storage.join(stage_uri, TRIALS_DIR))[0]:
        if posixpath.basename(rel) != MARKER:
            continue
        part = posixpath.join(TRIALS_DIR, posixpath.dirname(rel))
        try:
            marker = json.loads(storage.read_text(_uri(stage_uri, f"{part}/{MARKER}")))
        except (OSError, ValueError):
            continue
        if isinstance(marker, dict) and isinstance(marker.get("files"), list):
            out[part] = marker
    return out


def _listed(marker: dict[str, Any]) -> dict[str, int]:
    """{file relative to its part: size} a marker lists (entries that are not a safe path and size are ignored)."""
    return {f["path"]: f["size"] for f in marker["files"]
            if isinstance(f, dict) and safe_relative(f.get("path")) and isinstance(f.get("size"), int)}


def kept_files(stage_uri: str) -> set[str]:
    """Every file of a committed part, markers included, relative to the stage folder: what the workflow's
    cleanup must neither delete nor call foreign."""
    return {f"{part}/{rel}" for part, marker in _markers(stage_uri).items() for rel in [MARKER, *_listed(marker)]}


def count(stage_uri: str) -> int:
    return len(_markers(stage_uri))


def part_path(*names: str) -> str:
    """The part folder of a trial named by `names` (e.g. "MRPC", "lr=2e-05", "seed=1"), relative to the stage."""
    return posixpath.join(TRIALS_DIR, *names)


def load_committed(stage_uri: str, part: str, key: str) -> dict[str, Any] | None:
    """The kept result of `part`, if its marker is for `key` and every file it lists is there at its size."""
    marker = _markers(stage_uri).get(part)
    if marker is None or marker.get("key") != key or not isinstance(marker.get("result"), dict):
        return None
    present = dict(storage.list_all(_uri(stage_uri, part))[0])
    if any(present.get(rel) != size for rel, size in _listed(marker).items()):
        return None
    return marker["result"]


def commit(stage_uri: str, part: str, key: str, result: dict[str, Any]) -> None:
    """Mark `part` finished: its files now (writers' temporaries aside) with their sizes, and `result`."""
    files = [{"path": rel, "size": size} for rel, size in storage.list_all(_uri(stage_uri, part))[0]
             if rel != MARKER and not storage.is_temp(rel)]
    marker = {"key": key, "files": files, "result": result, "written_at": time.time()}
    storage.write_text_atomic(_uri(stage_uri, f"{part}/{MARKER}"), json.dumps(marker, default=_plain))


def _plain(value: Any) -> Any:
    """numpy scalars and arrays in a result as plain numbers and lists (anything else is a TypeError)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a kept trial result holds a {type(value).__name__}, which JSON cannot hold")


def drop(stage_uri: str, part: str) -> None:
    """Delete a part folder whole (a failed trial's half-written one, or a part no longer asked for)."""
    storage.delete_dir(_uri(stage_uri, part))


def drop_all_but(stage_uri: str, wanted: set[str]) -> None:
    """Delete every committed part not in `wanted` (kept by a run with another config or other tasks)."""
    for part in _markers(stage_uri):
        if part not in wanted:
            drop(stage_uri, part)


def drop_all(stage_uri: str) -> None:
    storage.delete_dir(storage.join(stage_uri, TRIALS_DIR))
