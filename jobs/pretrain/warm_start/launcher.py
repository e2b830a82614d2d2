"""The Python command of a training worker (Ray runs `<this> default_worker.py --raylet-name=... ...`).

Asks the warm process of this node and this worker environment (zygote.py) to fork the worker; starts that process
when there is none yet (the first worker of a node waits for its imports, which it would otherwise have done
itself); runs the worker cold, with this interpreter, when a fork is not to be had. The forked worker gets this
process's standard streams, environment and directory; this process stays as long as the worker, passes on the
signals it gets, and exits with the worker's exit code (Ray started this process: killing it kills the worker).

Standard library only, and nothing imported at start that a cold worker would not need: it runs once per worker.
"""
from __future__ import annotations

import array
import fcntl
import hashlib
import json
import os
import signal
import socket
import stat
import struct
import sys
import time

ZYGOTE_MODULE = "bertpipe.jobs.pretrain.warm_start.zygote"
# A fork is refused with 0 instead of a pid (the warm process cannot fork safely: zygote.py says why in its log).
REFUSED = 0
# How long the first worker of a node waits for its warm process's imports before it starts cold: well within the
# time Ray gives a worker to register (RAY_worker_register_timeout_seconds, 60 s by default), so that a cold start
# after the wait still registers in time.
READY_TIMEOUT_S = 0.6 * float(os.environ.get("RAY_worker_register_timeout_seconds", "60"))
FAILED = ".failed"  # beside the socket: the warm process of this node and key could not start
# sun_path holds 108 bytes on Linux, its NUL included; the warm process binds `<socket>.<pid>` first (zygote.py)
UNIX_PATH_MAX = 96
SHORT_SOCKETS = "/tmp"  # where a socket whose path would be longer goes, named SHORT_PREFIX + a hash of that path
SHORT_PREFIX = "bertpipe-warm-"


def environment_key(env: dict[str, str], cwd: str) -> str:
    """Workers of one key share a warm process: it imported under that environment, directory and interpreter."""
    return hashlib.sha256(json.dumps([sys.executable, cwd, sorted(env.items())]).encode()).hexdigest()[:16]


def warm_path(argv: list[str], key: str) -> str:
    """The warm process of this node and key: its lock, pid, log and socket are named after this path, beside the
    raylet's own socket (one warm process per node, also where nodes share a host), in the Ray session's folder."""
    raylet = next((a.split("=", 1)[1] for a in argv if a.startswith("--raylet-name=")), "")
    return os.path.join(os.path.dirname(raylet) or "/tmp", f"warm-{os.path.basename(raylet) or 'worker'}-{key}")


def socket_address(path: str) -> str:
    """The warm process's socket: `path` itself, or a name in /tmp when `path` would not fit a Unix socket's name
    (a deep Ray temp folder); the warm process removes it when it ends. Only the socket moves: the other files stay
    in the Ray session's folder, where the run's stop finds them (warm_process_pids)."""
    if len(path) <= UNIX_PATH_MAX:
        return path
    return os.path.join(SHORT_SOCKETS, SHORT_PREFIX + hashlib.sha256(path.encode()).hexdigest()[:24])


def remove_stale_sockets(folder: str = SHORT_SOCKETS) -> None:
    """Removes the sockets in SHORT_SOCKETS (socket_address) of warm processes that ended without removing theirs
    (killed with SIGKILL): a socket that refuses connections has no process behind it."""
    for name in os.listdir(folder):
        candidate = os.path.join(folder, name)
        try:
            if not name.startswith(SHORT_PREFIX) or not stat.S_ISSOCK(os.lstat(candidate).st_mode):
                continue
        except FileNotFoundError:
            continue
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(candidate)
        except ConnectionRefusedError:
            try:
                os.unlink(candidate)
            except OSError:
                pass
        except OSError:
            pass  # another user's, or gone meanwhile
        finally:
            probe.close()


def log_path(socket_file: str) -> str:
    """The warm process's log: in the Ray session's logs folder (sockets/ sits beside logs/), else beside the
    socket."""
    folder = os.path.dirname(socket_file)
    logs = os.path.join(os.path.dirname(folder), "logs")
    return os.path.join(logs if os.path.basename(folder) == "sockets" and os.path.isdir(logs) else folder,
                        f"bertpipe-{os.path.basename(socket_file)}.log")


def connect(path: str) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(socket_address(path))
        return conn
    except OSError:
        conn.close()
        return None


def start_and_connect(path: str) -> socket.socket | None:
    """Connects to the warm process, starting it first if none is running or starting; None when it is not ready
    within READY_TIMEOUT_S (the worker then starts cold; the warm process goes on and serves the later ones)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with open(path + ".lock", "a") as lock:
        while True:  # one launcher of the node and key starts it; the others wait for its socket
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                conn = connect(path)
                if conn is not None or time.monotonic() > deadline:
                    return conn
                time.sleep(0.05)
        conn = connect(path)
        if conn is not None or os.path.exists(path + FAILED):
            return conn  # FAILED: it could not start once on this node; the key's workers start cold
        zygote = read_pid(path + ".pid")
        if not alive(zygote):  # none is starting (a launcher before this one may have given up waiting for it)
            if os.path.exists(socket_address(path)):
                os.unlink(socket_address(path))  # a socket whose process is gone
            remove_stale_sockets()
            zygote = start_detached([sys.executable, "-m", ZYGOTE_MODULE, path], log_path(path))
            with open(path + ".pid", "w") as pid_file:
                pid_file.write(str(zygote))
        while time.monotonic() < deadline and alive(zygote):
            conn = connect(path)
            if conn is not None:
                return conn
            time.sleep(0.05)
        if not alive(zygote):
            with open(path + FAILED, "w") as failed:
                failed.write(f"the warm process exited before it was ready: {log_path(path)}\n")
        return None


def read_pid(path: str) -> int:
    try:
        with open(path) as pid_file:
            return int(pid_file.read().strip() or -1)
    except (OSError, ValueError):
        return -1


def warm_process_pids(sockets_dir: str) -> list[int]:
    """The warm processes started for the raylets whose sockets are in `sockets_dir` (a Ray session's), alive."""
    pids = []
    for name in sorted(os.listdir(sockets_dir)) if os.path.isdir(sockets_dir) else []:
        if name.startswith("warm-") and name.endswith(".pid"):
            pid = read_pid(os.path.join(sockets_dir, name))
            if alive(pid):
                pids.append(pid)
    return pids


def start_detached(command: list[str], log_file: str) -> int:
    """Starts `command` as no process's child (forked twice, in a session of its own): Ray kills what a worker's
    process leaves behind when the worker ends, and the warm process outlives the worker that started it."""
    ready_read, ready_write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(ready_read)
            os.setsid()
            grandchild = os.fork()
            if grandchild == 0:
                log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.closerange(3, 1 << 16)  # no descriptor of the worker's (its Ray sockets) held by it
                os.execv(command[0], command)
            os.write(ready_write, struct.pack("!i", grandchild))
        finally:
            os._exit(0)
    os.close(ready_write)
    os.waitpid(child, 0)
    with os.fdopen(ready_read, "rb") as ready:
        data = ready.read(4)
    return struct.unpack("!i", data)[0] if len(data) == 4 else -1


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited (a PID 1 may not reap)
    except (OSError, IndexError):
        return False


def read_int(conn: socket.socket) -> int | None:
    data = b""
    while len(data) < 4:
        chunk = conn.recv(4 - len(data))
        if not chunk:
            return None
        data += chunk
    return struct.unpack("!i", data)[0]


def request_fork(conn: socket.socket, argv: list[str], env: dict[str, str], cwd: str) -> int | None:
    """The forked worker's pid; None (refused, or the warm process went away)."""
    body = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
    try:
        conn.sendmsg([struct.pack("!I", len(body)) + body],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        pid = read_int(conn)
    except OSError:
        return None
    return pid if pid and pid != REFUSED else None


def run_cold(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def wait_for_worker(conn: socket.socket, pid: int) -> int:
    """The forked worker's exit code, passing it the signals this process gets meanwhile."""
    def pass_on(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, pass_on)
    code = read_int(conn)
    return 1 if code is None else code


def main(argv: list[str]) -> None:
    env, cwd = dict(os.environ), os.getcwd()
    path = warm_path(argv, environment_key(env, cwd))
    conn = connect(path) or start_and_connect(path)
    pid = request_fork(conn, argv, env, cwd) if conn is not None else None
    if pid is None:
        run_cold(argv)
    sys.exit(wait_for_worker(conn, pid))


if __name__ == "__main__":
    main(sys.argv[1:])
