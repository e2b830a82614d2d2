"""The first hour's `make run`, shared by the tests that inspect one whole workflow run as a user runs it
(tests/test_first_hour.py, tests/test_first_run.py, tests/test_watching.py; conftest's `clone` and `made_run`).

The clone is `git clone` of this repository with the working tree's uncommitted files copied over (the tree under
test). Its `.venv` is made as `make setup` makes it, minus the downloads: a venv of the same Python whose
site-packages path lists this test environment's (the same pinned stack), the clone installed into it editable
(`pip install -e`, offline) and the console scripts of the stack (mlflow, ray, ...) beside its python;
`.venv/.installed` (the product) and `.venv/.installed-test` (the test extras: the stack has them) are then newer than
pyproject.toml and the locks, so `make run` goes straight to `bertpipe fetch-sample`
(offline too: the gensim wheel is copied into the clone's data/downloads, and fetch-sample extracts the dumps
from it) and the run. DeepSpeed's JIT cache is an empty folder (TORCH_EXTENSIONS_DIR), as on a new machine; Ray's
temp dir is one of the run's own (RAY_TMPDIR), so a test can look inside Ray's folders afterwards.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _copy_tree_under_test(dest: Path) -> None:
    """`git clone` of the repo, then the working tree's modified and untracked (not ignored) files over it, and
    its deletions: the clone holds exactly the tree under test."""
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(dest)], check=True, timeout=120)
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src, dst = REPO / rel, dest / rel
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        elif not src.exists() and dst.exists():
            dst.unlink()


def _venv_without_downloads(clone: Path) -> None:
    venv = clone / ".venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                                  check=True).stdout.strip())
    # A path line in a .pth: this environment's packages importable, without running its own .pth files (its
    # editable finder would import the repo's code instead of the clone's).
    (purelib / "_bertpipe_test_stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", "-e", str(clone)], check=True, capture_output=True, timeout=300)
    here, there = Path(sys.executable).parent, venv / "bin"
    shebang = f"#!{here / 'python'}".encode()
    for script in here.iterdir():
        target = there / script.name
        if target.exists() or not script.is_file():
            continue
        data = script.read_bytes()
        if data.startswith(shebang + b"\n") or data.startswith(shebang + b" "):
            target.write_bytes(f"#!{there / 'python'}".encode() + data[len(shebang):])
            target.chmod(0o755)
    (venv / ".installed").touch()  # newer than pyproject.toml and locks/cpu.txt: make skips setup
    (venv / ".installed-test").touch()  # newer than .installed and locks/test.txt: make skips setup-test


def clean_env(**extra: str) -> dict[str, str]:
    """The user's shell: no venv on PATH, no virtualenv, no tracking URI or Ray address of the test session."""
    drop = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "MLFLOW_TRACKING_URI", "RAY_ADDRESS", "MAKEFLAGS", "MFLAGS",
            "MAKELEVEL"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not p.rstrip("/").endswith("/.venv/bin")
                                  and Path(p).resolve() != Path(sys.executable).parent.resolve())
    return {**env, **extra}


def _read_lines(stream, out: list, t0: float) -> None:
    for line in stream:
        out.append((time.monotonic() - t0, time.time(), line.rstrip("\n")))


def new_clone(dest: Path) -> str | None:
    """The clone at `dest`, ready for `make run`; or why it cannot be made here (a test skips with it)."""
    for tool in ("git", "make", "bash"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    wheels = sorted((REPO / "data" / "downloads").glob("gensim-4.4.0-*.whl"))
    if not wheels:
        return "the gensim wheel is not in data/downloads (bertpipe fetch-sample puts it there)"
    _copy_tree_under_test(dest)
    _venv_without_downloads(dest)
    (dest / "data" / "downloads").mkdir(parents=True)
    shutil.copy2(wheels[0], dest / "data" / "downloads" / wheels[0].name)
    return None


def _ask_dashboard(url: str) -> int | str:
    """The HTTP status of the dashboard's version page: 200, or 401 with token auth on (it answers and refuses the
    anonymous caller); the error's text when nothing answers."""
    try:
        with urllib.request.urlopen(url + "/api/version", timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError as err:
        return str(err)


@contextlib.contextmanager
def make_run(clone: Path):
    """`make run` in the clone: each console line (stdout and stderr) with its arrival time, and the answer of the
    dashboard it printed, asked while the run goes."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="bpfh-", dir="/tmp"))  # Ray's socket paths must stay short
    ops = Path(tempfile.mkdtemp(prefix="bpfh-ops-"))  # DeepSpeed's JIT cache, empty: a new machine
    env = clean_env(RAY_TMPDIR=str(ray_tmp), TORCH_EXTENSIONS_DIR=str(ops))
    t0 = time.monotonic()
    proc = subprocess.Popen(["make", "run"], cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    out, err = [], []
    readers = [threading.Thread(target=_read_lines, args=(proc.stdout, out, t0), daemon=True),
               threading.Thread(target=_read_lines, args=(proc.stderr, err, t0), daemon=True)]
    for r in readers:
        r.start()
    dashboard, deadline = None, t0 + 1800
    while proc.poll() is None and time.monotonic() < deadline:
        if dashboard is None:
            found = [m for _, _, line in list(out) if (m := re.search(r"dashboard (http://127\.0\.0\.1:\d+)", line))]
            dashboard = _ask_dashboard(found[0].group(1)) if found else None
        time.sleep(0.2)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # our own make and what it started
    proc.wait()
    for r in readers:
        r.join(timeout=30)
    ended = time.monotonic() - t0
    lines = sorted(out + err, key=lambda x: x[0])
    try:
        yield {"rc": proc.returncode, "lines": lines, "stdout": [line for _, _, line in sorted(out)],
               "stderr": [line for _, _, line in sorted(err)], "ended": ended, "clone": clone,
               "workdir": clone / "work" / "tiny", "env": clean_env(), "dashboard": dashboard, "ray_tmp": ray_tmp,
               "ops_built": sorted(p.name for p in ops.rglob("*") if p.is_file())}
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(ops, ignore_errors=True)
