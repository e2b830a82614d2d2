"""One run per workdir: a lock taken before a run writes anything into its workdir, released on every exit.

Two runs writing one workdir corrupt each other (one renames the other's temporary files, one commits the other's
half-written shards), so a second run must stop at once and say who holds the workdir. The lock is a small JSON
record, `<workdir>/.bertpipe.lock`: host, pid, start time, the command (masked), and for object stores a lease.

Local (and shared) file systems: the record is a file held with flock(2). The kernel drops that lock when its
holder dies, however it dies (kill -9 included), so "is the holder still there" never rests on a pid alone: a
run that finds the file but gets the flock knows the writer of the record is gone, and says that it takes over.
A record from another host is not taken over (its flock may not reach this host on a network file system that
does not forward locks); the refusal names the file to delete once that run is known to be gone. A clean exit
unlinks the file (while still holding it) so a finished workdir carries no lock; folders the lock had to create
are removed again when nothing else was written into them.

Object stores (s3://, gs://): no flock, so the record is an object created atomically, only if absent (S3
`If-None-Match: *`, GCS `ifGenerationMatch=0`), and then held as a lease: a thread rewrites it every lease/4
seconds, each write conditional on the version it last wrote (S3 `If-Match: <ETag>`, GCS generation match),
and the release deletes it under the same condition. A record whose lease ran out (the object's own
modification time, the store's clock, older than the lease its holder declared) is taken over by a conditional
replace, so two runs racing for a dead holder's lease cannot both win; so is one written on this host by a pid
that is no longer alive.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from typing import Callable, Iterator
from urllib.parse import parse_qs, urlsplit

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.paths import WorkdirPaths
from bertpipe.pipeline.framework.redact import mask

DEFAULT_LEASE_S = 120.0  # an object-store lock not renewed for this long belongs to a run that is gone
log = logging.getLogger(__name__)
Note = Callable[[str], None]


class WorkdirBusy(RuntimeError):
    """Another run holds the workdir; the message is the one line the CLI shows."""


def holder_record(command: str | None = None) -> dict:
    """Who takes the lock: what a refused run shows, and what a later run checks to see if the holder is gone."""
    argv = [os.path.basename(sys.argv[0]) or "python", *sys.argv[1:]]
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
            "command": mask(command if command is not None else shlex.join(argv)),
            # makes every record's bytes (and so an S3 ETag) unique, even for two identical commands
            "nonce": uuid.uuid4().hex}


def holder_text(record: dict) -> str:
    started = record.get("started")
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float))
            else "unknown")
    return (f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, started {when}, "
            f"command: {record.get('command', '?')}")


def _parse(data: bytes) -> dict | None:
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def pid_alive(pid: int, since: float | None = None) -> bool:
    """Whether `pid` runs on this host and is the process that took the lock at `since` (not a reused pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, as another user's process
    try:
        import psutil
    except ImportError:
        return True
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        # A process created after the lock was taken only reuses the holder's pid.
        return since is None or proc.create_time() <= since + 1.0
    except psutil.NoSuchProcess:
        return False


def _gone_reason(record: dict) -> str | None:
    """Why the holder of `record` is known to be gone, or None when it may still run."""
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int):
        return None
    if pid == os.getpid():
        return None  # this very process holds it (a second acquire in one process is refused like any other)
    started = record.get("started")
    if not pid_alive(pid, started if isinstance(started, (int, float)) else None):
        return f"pid {pid} is no longer running"
    return None


# ---------------------------------------------------------------------------------------------------------
# Local file systems: flock on the lock file


class _LocalLock:
    def __init__(self, workdir: str, path: str, fd: int, created: list[str]):
        self.workdir, self.path, self._fd, self._created = workdir, path, fd, created
        self._owner = os.getpid()

    def release(self) -> None:
        if self._fd < 0 or os.getpid() != self._owner:  # a forked child never releases its parent's lock
            return
        fd, self._fd = self._fd, -1
        try:
            if _same_file(fd, self.path):
                os.unlink(self.path)  # unlinked while still locked: the next run creates a fresh file
        finally:
            os.close(fd)  # drops the flock
        for folder in reversed(self._created):
            try:
                os.rmdir(folder)  # only while empty: a run that wrote something keeps its folders
            except OSError:
                break


def _makedirs(folder: str) -> list[str]:
    """Create `folder` and missing parents; the ones created, outermost first."""
    missing = []
    while not os.path.isdir(folder):
        missing.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    created = []
    for path in reversed(missing):
        try:
            os.mkdir(path)
            created.append(path)
        except FileExistsError:
            pass
    return created


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _flock(fd: int) -> bool | None:
    """True: locked. False: another process holds it. None: this file system has no locks."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise


def _read_fd(fd: int) -> bytes:
    return os.pread(fd, 1 << 16, 0)


def _current_record(path: str) -> dict:
    """The holder's record; it may be a moment from written when the flock is already taken, so wait a little."""
    for _ in range(20):
        try:
            with open(path, "rb") as f:
                record = _parse(f.read())
        except FileNotFoundError:
            record = None
        if record:
            return record
        time.sleep(0.05)
    return {}


def _busy(workdir: str, path: str, record: dict, why: str = "") -> WorkdirBusy:
    who = holder_text(record) if record else "a run that has not written its record yet"
    return WorkdirBusy(f"workdir {mask(workdir)} is in use by another run ({who}){why}; wait for it to end or "
                       f"stop it (lock: {mask(path)})")


def _acquire_local(workdir: str, path: str, record: dict, note: Note) -> _LocalLock:
    created = _makedirs(os.path.dirname(path))
    try:
        for _ in range(20):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # O_CLOEXEC: Python fds are not inherited
            ours = False  # the file holds (part of) our record: an error or a signal before we return removes it
            try:
                locked = _flock(fd)
                if locked is False:
                    holder = _current_record(path)
                    pid = holder.get("pid")
                    why = (f"; pid {pid} has exited but a process it started still holds the lock"
                           if holder and _gone_reason(holder) else "")
                    raise _busy(workdir, path, holder, why)
                if not _same_file(fd, path):
                    os.close(fd)  # its holder unlinked it while releasing: lock the file that is there now
                    continue
                previous = _parse(_read_fd(fd))
                if previous:
                    # With the flock taken the record's writer is gone, unless the file system has no locks, or
                    # the writer is on another host whose locks this one cannot see: there the pid decides.
                    reason = _gone_reason(previous)
                    if reason is None and (locked is None or previous.get("host") != socket.gethostname()):
                        raise _busy(workdir, path, previous, "" if previous.get("host") == socket.gethostname()
                                    else "; it runs on another host, so whether it still runs cannot be checked "
                                         "from here: if it is gone, delete the lock file")
                    if reason is None:
                        reason = "it no longer holds the lock"
                    note(f"took over the workdir lock left by a run that is gone ({holder_text(previous)}): {reason}")
                data = json.dumps(record, sort_keys=True).encode()
                ours = True
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)  # a full disk refuses it: the empty file must not stay behind
                os.fsync(fd)
                return _LocalLock(workdir, path, fd, created)
            except BaseException:
                # SIGTERM right after the record was written (a run stopped as it starts) must not leave it behind.
                with contextlib.suppress(OSError):
                    if ours and _same_file(fd, path):
                        os.unlink(path)  # still under our flock: nobody else has read it as theirs
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
        raise WorkdirBusy(f"workdir {mask(workdir)}: its lock {mask(path)} keeps changing hands; try again")
    except BaseException:
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise


# ---------------------------------------------------------------------------------------------------------
# Object stores: a conditionally written object held as a lease


class _S3Object:
    """The lock object through boto3 (conditional writes: S3 since 2024, and S3-compatible stores)."""

    def __init__(self, uri: str):
        import boto3

        parts = urlsplit(uri)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        kwargs = {}
        # The same spellings pyarrow accepts in an s3:// URI, so a workdir that works for the data works here.
        if parts.username or parts.password:
            kwargs.update(aws_access_key_id=parts.username, aws_secret_access_key=parts.password)
        if query.get("endpoint_override"):
            endpoint = query["endpoint_override"]
            kwargs["endpoint_url"] = endpoint if "://" in endpoint else f"{query.get('scheme', 'https')}://{endpoint}"
        if query.get("region"):
            kwargs["region_name"] = query["region"]
        self.bucket, self.key = parts.hostname or "", parts.path.lstrip("/")
        self.client = boto3.client("s3", **kwargs)

    def _refused(self, exc) -> bool:
        response = getattr(exc, "response", {}) or {}
        code = response.get("Error", {}).get("Code", "")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        # 409 ConditionalRequestConflict: another conditional write to the key was in flight; it won.
        return code in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey") or status in (409, 412)

    def create(self, body: bytes) -> str | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body, IfNoneMatch="*")["ETag"]
        except ClientError as exc:
            if self._refused(exc):
                return None
            raise

    def read(self) -> tuple[bytes, str, float] | None:
        from botocore.exceptions import ClientError

        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except ClientError as exc:
            if self._refused(exc) or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            raise
        return got["Body"].read(), got["ETag"], got["LastModified"].timestamp()

    def replace(self, body: bytes, tag: str) -> str | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body, IfMatch=tag)["ETag"]
        except ClientError as exc:
            if self._refused(exc):
                return None
            raise

    def delete(self, tag: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=tag)
            return True
        except ClientError as exc:
            if self._refused(exc):
                return False
            raise


class _GcsObject:
    """The lock object through google-cloud-storage: preconditions on the object's generation."""

    def __init__(self, uri: str):
        from google.cloud import storage as gcs

        parts = urlsplit(uri)
        self.key = parts.path.lstrip("/")
        self.bucket = gcs.Client().bucket(parts.hostname or "")

    def create(self, body: bytes) -> str | None:
        from google.api_core.exceptions import PreconditionFailed

        blob = self.bucket.blob(self.key)
        try:
            blob.upload_from_string(body, if_generation_match=0)  # 0: only if no live object has the name
        except PreconditionFailed:
            return None
        return str(blob.generation)

    def read(self) -> tuple[bytes, str, float] | None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        blob = self.bucket.get_blob(self.key)
        if blob is None:
            return None
        try:
            body = blob.download_as_bytes(if_generation_match=blob.generation)
        except (NotFound, PreconditionFailed):
            return None
        return body, str(blob.generation), blob.updated.timestamp()

    def replace(self, body: bytes, tag: str) -> str | None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        blob = self.bucket.blob(self.key)
        try:
            blob.upload_from_string(body, if_generation_match=int(tag))
        except (NotFound, PreconditionFailed):
            return None
        return str(blob.generation)

    def delete(self, tag: str) -> bool:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        try:
            self.bucket.blob(self.key).delete(if_generation_match=int(tag))
            return True
        except (NotFound, PreconditionFailed):
            return False


class _LeaseLock:
    def __init__(self, workdir: str, path: str, store, record: dict, tag: str, lease_s: float):
        self.workdir, self.path, self.lease_s = workdir, path, lease_s
        self._store, self._record, self._tag = store, record, tag
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="bertpipe-workdir-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            self._record["renewed"] = time.time()
            try:
                tag = self._store.replace(json.dumps(self._record, sort_keys=True).encode(), self._tag)
            except Exception as exc:  # a blip: the next renewal may pass, well inside the lease
                log.warning("could not renew the workdir lock %s: %s", mask(self.path), exc)
                continue
            if tag is None:
                self.lost = True
                log.error("lost the workdir lock %s: its lease ran out and another run took the workdir over; "
                          "this run's further writes may collide with it", mask(self.path))
                return
            self._tag = tag

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=30)
        if not self.lost:
            try:
                self._store.delete(self._tag)  # conditional: never deletes a lock another run has taken over
            except Exception as exc:
                log.warning("could not remove the workdir lock %s (it expires by itself): %s", mask(self.path), exc)


def _acquire_lease(workdir: str, path: str, store, record: dict, note: Note, lease_s: float) -> _LeaseLock:
    record = {**record, "lease_s": lease_s, "renewed": record["started"]}
    body = json.dumps(record, sort_keys=True).encode()
    for _ in range(10):
        tag = store.create(body)
        if tag:
            return _LeaseLock(workdir, path, store, record, tag, lease_s)
        current = store.read()
        if current is None:
            continue  # released between our create and our read: create again
        data, tag, modified = current
        previous = _parse(data) or {}
        age = time.time() - modified
        declared = previous.get("lease_s")
        lease = float(declared) if isinstance(declared, (int, float)) and declared > 0 else DEFAULT_LEASE_S
        reason = _gone_reason(previous) or (
            f"its lease ran out {age - lease:.0f} s ago (last renewed {age:.0f} s ago)" if age > lease else None)
        if reason is None:
            raise _busy(workdir, path, previous, f"; lease renewed {max(age, 0):.0f} s ago, taken over if not "
                                                 f"renewed within {max(lease - age, 0):.0f} s")
        new_tag = store.replace(body, tag)
        if new_tag is None:
            continue  # another run took it over first (or it was renewed): look again
        note(f"took over the workdir lock left by a run that is gone ({holder_text(previous)}): {reason}")
        return _LeaseLock(workdir, path, store, record, new_tag, lease_s)
    raise WorkdirBusy(f"workdir {mask(workdir)}: its lock {mask(path)} keeps changing hands; try again")


# ---------------------------------------------------------------------------------------------------------


class _NoLock:
    def release(self) -> None:
        pass


def acquire(workdir: str, *, command: str | None = None, note: Note | None = None,
            lease_s: float = DEFAULT_LEASE_S):
    """Take `workdir`'s lock or raise WorkdirBusy naming its holder. `note` gets the one line said when the lock
    of a run that is gone is taken over. Returns an object with `release()` (idempotent)."""
    note = note or (lambda line: log.warning("%s", line))
    path = WorkdirPaths(workdir).lock
    record = holder_record(command)
    scheme = workdir.split("://", 1)[0].lower() if storage.is_remote(workdir) else ""
    if not scheme:
        return _acquire_local(workdir, path, record, note)
    if scheme in ("s3", "gs", "gcs"):
        try:
            store = _S3Object(path) if scheme == "s3" else _GcsObject(path)
            return _acquire_lease(workdir, path, store, record, note, lease_s)
        except WorkdirBusy:
            raise
        except Exception as exc:  # no credentials, no bucket, no network: one line, like any bad input
            raise ValueError(f"cannot take the lock of workdir {mask(workdir)} ({mask(path)}): "
                             f"{type(exc).__name__}: {mask(str(exc))}") from exc
    log.warning("workdir %s: no lock for %s:// workdirs, so nothing stops a second run from writing into it",
                mask(workdir), scheme)
    return _NoLock()


@contextlib.contextmanager
def hold(workdir: str, **kwargs) -> Iterator[object]:
    """`with hold(workdir): ...` — the lock for the duration of the block, released however the block ends."""
    lock = acquire(workdir, **kwargs)
    try:
        yield lock
    finally:
        lock.release()
