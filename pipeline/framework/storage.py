"""Folder-level I/O on local disk or object stores (s3://, gs://) through pyarrow.fs, so stages are URI-agnostic."""
from __future__ import annotations

import hashlib
import os
import posixpath
import re
import uuid

import pyarrow.fs as pafs


def is_remote(uri: str) -> bool:
    """True for a URI with a scheme (s3://, gs://, https://, file://), False for a plain local path: the one
    place the project tells the two apart."""
    return "://" in uri


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it). A local path must already be absolute: relative paths are resolved once,
    on the driver, when the config is loaded; here, possibly on a Ray worker whose working directory is Ray's
    per-run folder, a relative path would silently point somewhere else."""
    if not is_remote(uri):
        if not os.path.isabs(uri):
            raise ValueError(f"relative path {uri!r} reached storage: paths must be made absolute when the config "
                             "is loaded (jobs.config.load_config), not where the code happens to run")
        return pafs.LocalFileSystem(), uri
    return pafs.FileSystem.from_uri(uri)


def join(uri: str, *parts: str) -> str:
    if is_remote(uri):
        return posixpath.join(uri, *parts)
    return os.path.join(uri, *parts)


def exists(uri: str) -> bool:
    fs, path = resolve(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def write_text_atomic(uri: str, text: str) -> None:
    """Write a small file so that readers see either the old or the whole new content (tmp + rename)."""
    write_bytes(uri, text.encode("utf-8"))


def delete_file(uri: str) -> None:
    fs, path = resolve(uri)
    if fs.get_file_info(path).type == pafs.FileType.File:
        fs.delete_file(path)


# A writer's temporary name: the final name, 12 random hex digits, ".tmp". Unique per write, so two runs (or a task
# and its retry) never rename each other's file; the pattern lets a stage recognise its own leftovers.
TEMP_RE = re.compile(r"\.[0-9a-f]{12}\.tmp$")


def temp_path(path: str) -> str:
    """Where to write `path` before renaming it into place (see TEMP_RE)."""
    return f"{path}.{uuid.uuid4().hex[:12]}.tmp"


def is_temp(name: str) -> bool:
    return TEMP_RE.search(name) is not None


def list_all(uri: str) -> tuple[list[tuple[str, int]], list[str]]:
    """(every file as (relative path, size), every sub-folder's relative path) under `uri`, hidden ones included,
    sorted; relative paths use "/". Empty lists when `uri` is not a folder."""
    fs, path = resolve(uri)
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        return [], []
    files, dirs = [], []
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
        rel = info.path[len(path):].lstrip("/") if is_remote(uri) else os.path.relpath(info.path, path)
        rel = rel.replace(os.sep, "/")
        if info.type == pafs.FileType.File:
            files.append((rel, info.size))
        elif info.type == pafs.FileType.Directory:
            dirs.append(rel)
    return sorted(files), sorted(dirs)


def sha256(uri: str) -> str:
    """Hex sha256 of a file's bytes, streamed (any supported store)."""
    fs, path = resolve(uri)
    digest = hashlib.sha256()
    with fs.open_input_stream(path) as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def delete_empty_dir(uri: str) -> None:
    """Remove a folder if it holds nothing (object stores have no empty folders: nothing to do there)."""
    fs, path = resolve(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory and not fs.get_file_info(pafs.FileSelector(path)):
        fs.delete_dir(path)


def list_files(uri: str) -> list[tuple[str, int]]:
    """(relative path, size) of every file under `uri`, sorted; hidden and .tmp files are ignored."""
    fs, path = resolve(uri)
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        return []
    out = []
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
        if info.type != pafs.FileType.File:
            continue
        rel = os.path.relpath(info.path, path) if not is_remote(uri) else info.path[len(path):].lstrip("/")
        name = posixpath.basename(rel)
        if name.startswith((".", "_")) or name.endswith(".tmp"):
            continue
        out.append((rel, info.size))
    return sorted(out)


def _smart_open_only(uri: str) -> bool:
    # pyarrow.fs has no HTTP filesystem: https:// inputs (a dump or GLUE mirror) are read through smart_open.
    return uri.startswith(("http://", "https://"))


def read_bytes(uri: str) -> bytes:
    """A whole file (any supported URI). FileNotFoundError / OSError when it cannot be read."""
    if _smart_open_only(uri):
        import smart_open

        with smart_open.open(uri, "rb") as f:
            return f.read()
    fs, path = resolve(uri)
    with fs.open_input_stream(path) as f:
        return f.read()


def write_bytes(uri: str, data: bytes) -> None:
    """Write a file whole, creating its folder; atomic where the store allows (tmp + rename)."""
    fs, path = resolve(uri)
    fs.create_dir(posixpath.dirname(path) if is_remote(uri) else os.path.dirname(path), recursive=True)
    tmp = temp_path(path)
    try:
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        fs.move(tmp, path)
    except BaseException:
        # A write the disk refused (full) or a signal: no half-written temporary file stays behind.
        try:
            if fs.get_file_info(tmp).type == pafs.FileType.File:
                fs.delete_file(tmp)
        except OSError:
            pass
        raise


def is_file(uri: str) -> bool:
    if _smart_open_only(uri):
        import urllib.request

        try:  # HEAD: asking whether a (possibly large) file is there must not download it
            with urllib.request.urlopen(urllib.request.Request(uri, method="HEAD"), timeout=30) as resp:
                return resp.status < 400
        except OSError:
            return False
    fs, path = resolve(uri)
    return fs.get_file_info(path).type == pafs.FileType.File


def upload_dir(local_dir: str, uri: str) -> None:
    """Copy a local folder's files to `uri` (local or object store)."""
    fs, path = resolve(uri)
    fs.create_dir(path, recursive=True)
    pafs.copy_files(local_dir, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def copy_tree(src_uri: str, dst_uri: str) -> None:
    """Copy every file under `src_uri` to the same relative path under `dst_uri` (any two supported stores)."""
    for rel, _ in list_files(src_uri):
        write_bytes(join(dst_uri, *rel.split(os.sep)), read_bytes(join(src_uri, rel)))


def delete_dir(uri: str) -> None:
    fs, path = resolve(uri)
    if fs.get_file_info(path).type == pafs.FileType.Directory:
        fs.delete_dir(path)
