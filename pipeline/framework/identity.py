"""Identity of inputs the project did not make (dumps, vocab files, checkpoints, explicit stage inputs): size and
checksum per file, so a stage fingerprint notices a replaced file and a manifest names exactly what was read.

Local files: sha256, cached by (path, size, mtime) so re-fingerprinting a 20 GB dump is free. Object stores and
HTTP: the ETag (or size + modification time where pyarrow exposes no ETag); reading a remote dump twice just to
hash it would cost as much as the clean stage itself.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.stage import StageInputError

log = logging.getLogger(__name__)



def _cache_path() -> Path:
    root = os.environ.get("BERTPIPE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "bertpipe")
    return Path(root) / "sha256.json"


def _local_sha256(path: str) -> tuple[int, str]:
    """(size, sha256) of a local file, cached by (path, size, mtime) so re-fingerprinting a 20 GB dump is free."""
    st = os.stat(path)
    key = os.path.abspath(path)
    cache_file = _cache_path()
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    hit = cache.get(key)
    if hit and hit["size"] == st.st_size and hit["mtime_ns"] == st.st_mtime_ns:
        return st.st_size, hit["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    cache[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest.hexdigest()}
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(cache_file)
    except OSError as exc:  # a read-only home must not stop the pipeline; we only lose the cache
        log.warning("cannot write checksum cache %s: %s", cache_file, exc)
    return st.st_size, digest.hexdigest()


def _remote_identity(uri: str, what: str) -> tuple[int, str]:
    if uri.startswith(("http://", "https://")):
        import urllib.request

        try:
            with urllib.request.urlopen(urllib.request.Request(uri, method="HEAD"), timeout=30) as resp:
                headers = resp.headers
        except OSError as exc:
            raise StageInputError(f"{what} {uri} cannot be reached: {exc}") from exc
        size = int(headers.get("Content-Length") or -1)
        tag = headers.get("ETag") or headers.get("Last-Modified") or "unknown"
        return size, f"etag:{tag.strip(chr(34))}" if headers.get("ETag") else f"http:{tag}"
    import pyarrow.fs as pafs

    try:
        fs, path = pafs.FileSystem.from_uri(uri)
        info = fs.get_file_info(path)
    except (OSError, ValueError) as exc:
        raise StageInputError(f"{what} {uri} cannot be reached: {exc}") from exc
    if info.type != pafs.FileType.File:
        raise StageInputError(f"{what} {uri} does not exist")
    # pyarrow exposes no ETag; size + modification time still notice a re-uploaded dump.
    mtime = info.mtime.isoformat() if info.mtime else "unknown"
    return info.size, f"mtime:{mtime}"



def describe_file(uri: str, what: str = "input") -> dict[str, Any]:
    """{"uri", "size", "checksum"} of one file; StageInputError naming `what` if it is not there."""
    local = uri.removeprefix("file://") if not storage.is_remote(uri) or uri.startswith("file://") else None
    if local is None:
        size, tag = _remote_identity(uri, what)
        return {"uri": uri, "size": size, "checksum": tag}
    if not os.path.isfile(local):
        raise StageInputError(f"{what} {uri} does not exist")
    size, sha = _local_sha256(local)
    return {"uri": os.path.abspath(local), "size": size, "checksum": f"sha256:{sha}"}


def describe_tree(uri: str, what: str = "input") -> list[dict[str, Any]]:
    """describe_file of a file, or of every data file under a folder (sorted); StageInputError if there is none."""
    fs, path = storage.resolve(uri)
    kind = fs.get_file_info(path).type
    if kind == pafs.FileType.File:
        return [describe_file(uri, what)]
    if kind != pafs.FileType.Directory:
        raise StageInputError(f"{what} {uri} does not exist")
    files = storage.list_files(uri)
    if not files:
        raise StageInputError(f"{what} {uri} is an empty folder")
    return [describe_file(storage.join(uri, rel), what) for rel, _ in files]
