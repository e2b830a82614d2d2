"""Real servers for the MLflow tests, on 127.0.0.1, each in a process group of its own: an `mlflow server` that a
test can stop, freeze (SIGSTOP) and start again on the same port; PostgreSQL in a temporary folder (initdb, pg_ctl);
moto's S3 server. No mock: the client code under test talks HTTP (or PostgreSQL's protocol) to each."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ports import free_port_block

BIN = Path(sys.executable).parent
START_LIMIT_S = 300  # a hang guard, not a timing assertion: a loaded 2-core machine takes a minute to import mlflow


def _wait_for(ready, proc: subprocess.Popen | None, what: str, limit_s: float = START_LIMIT_S) -> None:
    give_up = time.monotonic() + limit_s
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        if time.monotonic() > give_up:
            raise RuntimeError(f"{what} not ready after {limit_s} s")
        time.sleep(0.3)


def _answers(url: str) -> bool:
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    return False


def _listens(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def quiet_env(**extra: str) -> dict[str, str]:
    """This environment without the session's MLflow, Ray and AWS settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RAY_", "AWS_"))}
    return {**env, **extra}


class MlflowServer:
    """`mlflow server <args>` on 127.0.0.1:port, started and stopped as the test says (same port each time)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.port = 0  # drawn at the first start (see Postgres), kept for every later one
        self.args, self.env, self.log = args, env, log
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = self.port or free_port_block(1)
        argv = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        _wait_for(lambda: _answers(f"{self.uri}/health"), self.proc, f"mlflow server (log: {self.log})")

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)  # its group: the server and the workers it started

    def stop(self) -> None:
        """Gone at once, as a crashed or redeployed server is: its port refuses connections."""
        if self.proc is None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=60)
        self.proc = None
        _wait_for(lambda: not _listens(self.port), None, "the stopped server's port to close", 60)


class Postgres:
    """A PostgreSQL cluster of its own in a new folder under the system temp dir (initdb), on a free port, trust
    auth on 127.0.0.1 only. As root, initdb and postgres (which refuse root) run as nobody, who must reach the folder:
    pytest's tmp_path is private to root, so the folder is not in it."""

    def __init__(self):
        self.port = 0  # drawn when it starts: free_port_block draws the same port again until someone binds it
        self.root = Path(tempfile.mkdtemp(prefix="bp-pg-"))
        self.data = self.root / "data"
        self.as_root = os.geteuid() == 0

    @staticmethod
    def available() -> str:
        missing = [tool for tool in ("initdb", "pg_ctl", "postgres") if shutil.which(tool) is None]
        return f"needs {', '.join(missing)} on PATH" if missing else ""

    def _run(self, *argv: str) -> None:
        prefix = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"] if self.as_root else []
        done = subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr or done.stdout}")

    def start(self) -> str:
        """Starts it; returns the SQLAlchemy URI of its database `mlflow`."""
        self.port = free_port_block(1)
        if self.as_root:
            import grp
            import pwd

            os.chown(self.root, pwd.getpwnam("nobody").pw_uid, grp.getgrnam("nogroup").gr_gid)
        self._run("initdb", "-D", str(self.data), "-U", "mlflow", "--auth=trust", "-E", "UTF8", "--no-sync")
        # Its socket in its own folder (the default /var/run/postgresql may be missing or not writable); no fsync: a
        # test's database need not survive a power cut.
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "postgres.log"), "-w", "-t", "120", "-o",
                  f"-p {self.port} -h 127.0.0.1 -k {self.root} -F", "start")
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user="mlflow", dbname="postgres")
        conn.autocommit = True
        conn.cursor().execute("CREATE DATABASE mlflow")
        conn.close()
        return f"postgresql+psycopg2://mlflow@127.0.0.1:{self.port}/mlflow"

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


class MotoS3:
    """moto's S3 server (its own process, S3's HTTP API) with one bucket."""

    def __init__(self, bucket: str):
        self.bucket, self.port = bucket, 0  # drawn when it starts (see Postgres)
        self.proc: subprocess.Popen | None = None
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1"}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = free_port_block(1)
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _wait_for(lambda: _listens(self.port), self.proc, "moto server")
        self.client().create_bucket(Bucket=self.bucket)

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)
