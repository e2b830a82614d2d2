"""A node's warm process: imports what a training worker imports, once, then forks a worker from itself for each
launcher.py that asks, as Python's forkserver does for multiprocessing.

Started by the first launcher of its node and worker environment (`python -m ... <path>`, launcher.warm_path), with
that launcher's environment, directory and interpreter, so a fork is the process a cold start would have been, less
the imports. It serves from one thread (a fork copies only the forking thread) and refuses to fork, sending the
launcher back to a cold start, once anything could make a fork unsafe: a second Python thread, CUDA initialised (a
forked child cannot use its parent's CUDA context), or Ray's ID generator seeded (every fork would make the same
IDs). It exits when its raylet is gone or no worker of it has lived for IDLE_EXIT_S; a worker it forked is Ray's:
the raylet ends it as it would a cold one, and when its launcher dies the warm process kills it.
"""
from __future__ import annotations

import array
import atexit
import importlib
import json
import logging
import os
import select
import signal
import socket
import struct
import sys
import threading
import time

from bertpipe.jobs.pretrain.warm_start.launcher import alive, socket_address

log = logging.getLogger("bertpipe.warm_start")

# What a training worker imports before its first step (seconds of one core, measured one after another: torch 1.4,
# dynamo 1.4, DeepSpeed 0.3, MLflow 0.9). DeepSpeed comes first, as the engine imports it (engine/deepspeed_start.py:
# without MLflow, its Muon module lazy). Not Ray Train, Ray Data or the loop (0.6-0.9 s more per worker): their
# `@ray.remote` classes draw an ID at import, which seeds Ray's ID generator, and a fork does not re-seed it: every
# worker forked after that made the same "random" task IDs, and two workers' calls to one actor collided in it
# (Ray's "Check failed: erased == 1", the actor's process gone). unsafe_to_fork() checks it.
PRELOAD = ("torch", "torch._dynamo", "mlflow", "ray")
IDLE_EXIT_S = float(os.environ.get("BERTPIPE_WARM_START_IDLE_EXIT_S", "600"))
IDLE_LOOK_S = 0.5
INHERITED_SIGTERM = signal.getsignal(signal.SIGTERM)
FORKED_ENV = "BERTPIPE_WARM_STARTED"  # set in each forked worker: the restart line says how its worker started


def warm_start_note() -> str:
    """How this worker process started, for its restart line: "" when Ray started it as a fresh Python."""
    return "forked from the node's warm process" if os.environ.get(FORKED_ENV) else ""


def preload() -> None:
    # torch.cuda.is_available() asked through NVML leaves CUDA uninitialised, so a fork stays possible.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    from bertpipe.jobs.pretrain.engine.deepspeed_start import start_deepspeed
    start_deepspeed()
    for name in PRELOAD:
        importlib.import_module(name)


def unsafe_to_fork() -> str:
    """Why a fork of this process now would not be a sound worker; "" when it would."""
    if threading.active_count() > 1:
        return f"{threading.active_count()} Python threads run (a fork keeps one)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised (a forked child cannot use it)"
    if forks_repeat_ray_ids():
        return "Ray's ID generator is seeded (every fork would make the same IDs)"
    return ""


def forks_repeat_ray_ids() -> bool:
    """Whether two forks of this process would draw the same Ray ID: Ray seeds its generator once per process, on
    its first ID, and not again after a fork. Asked of two throwaway forks, so this process draws none itself."""
    raylet = sys.modules.get("ray._raylet")
    if raylet is None:
        return False
    drawn = []
    for _ in range(2):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.write(write_end, raylet.UniqueID.from_random().binary())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            drawn.append(pipe.read())
        os.waitpid(pid, 0)
    return drawn[0] == drawn[1]


def read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """A launcher's {"argv", "env", "cwd"} and its standard streams' descriptors."""
    fds = array.array("i")
    header, ancillary, _flags, _addr = conn.recvmsg(4, socket.CMSG_LEN(3 * fds.itemsize))
    for _level, _type, data in ancillary:
        fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if len(header) < 4:
        raise ConnectionError("the launcher went away before its request")
    size, body = struct.unpack("!I", header)[0], b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the launcher went away during its request")
        body += chunk
    return json.loads(body), list(fds)


def become_worker(request: dict, fds: list[int]) -> None:
    """In the forked child: the launcher's streams, environment and directory, then Ray's worker script as
    `python <script> <args>` would run it. Never returns."""
    os.setsid()  # a group of its own, as Ray gives a worker: Ray ends a worker's group with it, not the warm process
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    # The signals as a cold worker gets them: this process inherited the launcher's (what Ray's worker start
    # ignores stays ignored) and changed only SIGTERM's.
    signal.signal(signal.SIGTERM, INHERITED_SIGTERM)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[FORKED_ENV] = "1"
    os.chdir(request["cwd"])
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    code = 1
    try:
        import runpy
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def raylet_exit_fd(pid: int | None) -> int | None:
    """A descriptor that becomes readable the moment the raylet exits (a pidfd), so the warm process is gone by the
    time Ray's shutdown returns; None where there is none (then it looks every IDLE_LOOK_S)."""
    if pid is None or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def worker_exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


class Zygote:
    def __init__(self, path: str, raylet_pid: int | None, unsafe: str):
        self.address, self.raylet_pid, self.unsafe = socket_address(path), raylet_pid, unsafe
        self.workers: dict[socket.socket, int] = {}  # a launcher's connection: the worker forked for it
        self.idle_since = time.monotonic()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        staging = f"{self.address}.{os.getpid()}"
        self.listener.bind(staging)
        self.listener.listen(64)
        os.rename(staging, self.address)  # launchers connect only to a process that listens
        self.inode = os.stat(self.address).st_ino
        self.raylet_exit = raylet_exit_fd(raylet_pid)

    def serve(self) -> None:
        while not self.should_exit():
            watched = [self.listener, *self.workers, *([self.raylet_exit] if self.raylet_exit is not None else [])]
            ready, _, _ = select.select(watched, [], [], IDLE_LOOK_S)
            for conn in ready:
                if conn is self.raylet_exit:
                    continue  # should_exit() says so at once
                if conn is self.listener:
                    self.accept()
                else:
                    self.launcher_spoke(conn)
            self.reap()

    def should_exit(self) -> bool:
        if self.raylet_pid is not None and not alive(self.raylet_pid):
            log.info("the raylet (pid %d) is gone: exiting", self.raylet_pid)
            return True
        if not self.workers and time.monotonic() - self.idle_since > IDLE_EXIT_S:
            log.info("no worker for %.0f s: exiting", IDLE_EXIT_S)
            return True
        return False

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        fds: list[int] = []
        try:
            conn.settimeout(10)
            request, fds = read_request(conn)
            conn.settimeout(None)
            if self.unsafe or len(fds) < 3:
                conn.sendall(struct.pack("!i", 0))
                conn.close()
                return
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                self.listener.close()
                if self.raylet_exit is not None:
                    os.close(self.raylet_exit)
                for other in self.workers:
                    other.close()
                conn.close()
                log.handlers.clear()
                become_worker(request, fds)
            self.workers[conn] = pid
            conn.sendall(struct.pack("!i", pid))
            log.info("forked worker %d", pid)
        except (OSError, ValueError, ConnectionError) as error:
            log.warning("a launcher's request failed: %s", error)
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)

    def launcher_spoke(self, conn: socket.socket) -> None:
        """A launcher sends nothing after its request: readable means it is gone, and its worker goes with it."""
        try:
            data = conn.recv(1)
        except OSError:
            data = b""
        if not data:
            pid = self.workers.pop(conn)
            conn.close()
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.mark_idle()

    def reap(self) -> None:
        for conn, pid in list(self.workers.items()):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                del self.workers[conn]
                try:
                    conn.sendall(struct.pack("!i", worker_exit_code(status)))
                except OSError:
                    pass
                conn.close()
                self.mark_idle()

    def mark_idle(self) -> None:
        if not self.workers:
            self.idle_since = time.monotonic()

    def close(self) -> None:
        """Ends the workers still running (their raylet is gone: Ray's own would end too), then the socket: a
        process that waits for this one's exit (jobs/cluster.py stop_writers) knows its workers are gone."""
        for pid in self.workers.values():
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        try:
            if os.stat(self.address).st_ino == self.inode:
                os.unlink(self.address)
        except FileNotFoundError:
            pass
        self.listener.close()


def main(path: str) -> None:
    handler = logging.StreamHandler()  # this process's stderr: its log file (launcher.log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(process)d: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    started = time.monotonic()
    preload()
    unsafe = unsafe_to_fork()
    raylet = os.environ.get("RAY_RAYLET_PID")
    zygote = Zygote(path, int(raylet) if raylet and raylet.isdigit() else None, unsafe)
    log.info("ready in %.1f s at %s%s", time.monotonic() - started, zygote.address,
             f"; refusing to fork: {unsafe}" if unsafe else "")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        zygote.serve()
    finally:
        zygote.close()


if __name__ == "__main__":
    main(sys.argv[1])
