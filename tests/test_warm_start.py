"""Warm worker starts (jobs/pretrain/warm_start/): workers forked from a node's warm process, on a real Ray; the
launcher's choices; and when the workers keep Ray's own start."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from own_python import run_alone

from bertpipe.jobs.pretrain.warm_start import launcher, zygote
from bertpipe.jobs.pretrain.warm_start.runtime_env import LAUNCHER_MODULE, worker_runtime_env

# A worker waits 0.6 × Ray's worker register timeout for its node's warm process (launcher.READY_TIMEOUT_S), then
# starts cold: on this machine under the suite's load the warm process's imports took 49 s once, past the default's 36.
# These tests are about the forks, not that wait: their Rays (their raylets and workers inherit it) wait long enough.
SLOW_IMPORTS = {"RAY_worker_register_timeout_seconds": "600"}
WITH_SLOW_IMPORTS = f"import os\nos.environ.update({SLOW_IMPORTS!r})\n"  # a script's first lines

# In a process of its own: the tests of a pytest worker share its Ray, which this one's must not replace.
FORKED_WORKERS = WITH_SLOW_IMPORTS + """
import os, sys, threading, time
import ray
from bertpipe.jobs.pretrain.warm_start.runtime_env import worker_runtime_env

def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\\0", " ")
    except FileNotFoundError:
        return ""

@ray.remote(num_cpus=1)
class Probe:
    def facts(self):
        preloaded = "torch" in sys.modules and "deepspeed" in sys.modules
        import torch
        ids = [ray._raylet.UniqueID.from_random().hex()]  # as Ray draws a task's or an actor class's ID
        drawer = threading.Thread(target=lambda: ids.append(ray._raylet.UniqueID.from_random().hex()))
        drawer.start()
        drawer.join()
        return {"pid": os.getpid(), "parent": cmdline(os.getppid()), "preloaded": preloaded, "ids": ids,
                "flag": os.environ.get("BERTPIPE_WARM_STARTED"), "mine": os.environ.get("MINE"),
                "sum": float(torch.ones(3).sum()), "cwd": os.getcwd()}

ray.init(num_cpus=1, include_dashboard=False)
env = dict(worker_runtime_env(True, {}), env_vars={"MINE": "kept"})
pids = []
for _ in range(2):  # the first starts the node's warm process, the second finds it
    probe = Probe.options(runtime_env=env).remote()
    facts = ray.get(probe.facts.remote())
    print("facts", facts, flush=True)
    pids.append(facts["pid"])
    ray.kill(probe)
    deadline = time.monotonic() + 60
    while cmdline(facts["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    print("killed", facts["pid"], "gone" if not cmdline(facts["pid"]) else "alive", flush=True)
cold = ray.get(Probe.remote().facts.remote())
print("cold", cold, flush=True)
ray.shutdown()
"""


@pytest.mark.integration
def test_workers_fork_from_the_nodes_warm_process_which_ends_with_its_raylet(tmp_path):
    out = run_alone(FORKED_WORKERS, tmp_path)
    told = [eval(line.split(" ", 1)[1]) for line in out.stdout.splitlines() if line.startswith("facts ")]
    assert len(told) == 2, out.stdout
    for facts in told:
        assert f"-m {zygote.__name__}" in facts["parent"], facts  # forked by the warm process
        assert facts["preloaded"] and facts["flag"] == "1" and facts["mine"] == "kept" and facts["sum"] == 3.0
    assert told[0]["parent"] == told[1]["parent"]  # one warm process served both
    assert not set(told[0]["ids"]) & set(told[1]["ids"])  # yet each fork draws its own IDs, in any thread
    assert out.stdout.count(" gone") == 2, out.stdout  # a killed actor's forked process ends
    cold = next(line for line in out.stdout.splitlines() if line.startswith("cold "))
    assert "'flag': None" in cold and "zygote" not in cold, cold  # without the runtime env: Ray's own start
    warm = told[0]["parent"].split()[-1]  # its socket's path names it
    left = lambda: subprocess.run(["pgrep", "-f", warm], capture_output=True).returncode == 0  # noqa: E731
    assert wait_for(lambda: not left()), "the warm process outlived Ray"


# The product's own stop of a local Ray (jobs/cluster.py stop_writers): the warm process and its forks, started
# detached from Ray's processes, are gone when it returns, as a cold worker would be.
STOPPED_WITH_RAY = WITH_SLOW_IMPORTS + """
import os, psutil, ray
from bertpipe.jobs import cluster
from bertpipe.jobs.pretrain.warm_start.runtime_env import worker_runtime_env

joined = cluster.ensure_ray(num_cpus=1, dashboard=False)

@ray.remote(num_cpus=1)
class Probe:
    def pids(self):
        return os.getpid(), os.getppid(), " ".join(psutil.Process(os.getppid()).cmdline())

fork, warm, cmdline = ray.get(Probe.options(runtime_env=worker_runtime_env(True, {})).remote().pids.remote())
print("warm", "zygote" in cmdline)
cluster.stop_writers(joined.how)
alive = [p for p in (fork, warm) if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
print("left", len(alive))
"""


@pytest.mark.integration
def test_the_runs_stop_of_a_local_ray_returns_once_the_warm_process_and_its_forks_are_gone(tmp_path):
    out = run_alone(STOPPED_WITH_RAY, tmp_path)
    assert "warm True" in out.stdout and "left 0" in out.stdout, out.stdout


SEEDED_BY_IMPORT = """
from bertpipe.jobs.pretrain.warm_start import zygote
zygote.preload()
print("preloaded", repr(zygote.unsafe_to_fork()))
import ray.data  # defines @ray.remote classes, each drawing an ID
print("ray.data", repr(zygote.unsafe_to_fork()))
"""


def test_the_warm_process_refuses_to_fork_once_rays_id_generator_is_seeded(tmp_path):
    out = run_alone(SEEDED_BY_IMPORT, tmp_path).stdout
    assert "preloaded ''" in out, out
    assert "ray.data \"Ray's ID generator is seeded" in out, out


def test_a_process_with_a_second_thread_is_not_forked():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert "Python threads" in zygote.unsafe_to_fork()
    finally:
        stop.set()
        thread.join()


def test_workers_of_another_environment_get_another_warm_process_and_long_paths_fit_a_socket():
    env = {"RAY_JOB_ID": "01000000", "A": "1"}
    key = launcher.environment_key(env, "/w")
    assert key == launcher.environment_key(dict(env), "/w")
    assert key != launcher.environment_key({**env, "A": "2"}, "/w") != launcher.environment_key(env, "/v")
    short = launcher.warm_path(["default_worker.py", "--raylet-name=/tmp/ray/s/sockets/raylet.2"], key)
    assert short == f"/tmp/ray/s/sockets/warm-raylet.2-{key}" == launcher.socket_address(short)
    deep = launcher.warm_path([f"--raylet-name=/{'d' * 120}/sockets/raylet"], key)
    assert deep == f"/{'d' * 120}/sockets/warm-raylet-{key}"  # its files stay in the session's folder
    address = launcher.socket_address(deep)  # only the socket moves
    assert address.startswith("/tmp/bertpipe-warm-") and len(address) <= launcher.UNIX_PATH_MAX
    assert address != launcher.socket_address(deep.replace("raylet", "raylet.2"))
    assert launcher.log_path("/tmp/ray/s/sockets/warm-raylet-k").endswith("/bertpipe-warm-raylet-k.log")


def test_a_socket_left_by_a_killed_warm_process_is_removed_and_a_live_ones_is_not():
    """A warm process killed with SIGKILL cannot remove its socket in /tmp: the next warm process to start removes
    those no process listens on."""
    import socket

    folder = Path(tempfile.mkdtemp(prefix="bpw-", dir="/tmp"))  # a short folder: a socket's name has 107 bytes
    live, dead = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    try:
        live.bind(str(folder / "bertpipe-warm-live"))
        live.listen(1)
        dead.bind(str(folder / "bertpipe-warm-dead"))  # bound, then its process gone: nobody listens
        dead.close()
        (folder / "bertpipe-warm-notes.log").write_text("not a socket")
        (folder / "someone-else").write_text("")
        launcher.remove_stale_sockets(str(folder))
        assert sorted(p.name for p in folder.iterdir()) == ["bertpipe-warm-live", "bertpipe-warm-notes.log",
                                                            "someone-else"]
    finally:
        live.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.integration
def test_a_warm_process_under_a_deep_ray_folder_keeps_its_files_there_and_leaves_nothing_in_tmp(tmp_path):
    """A Ray temp folder too deep for a Unix socket's name (a pytest tmp_path, a long $RAY_TMPDIR): the socket goes
    to /tmp and is removed when the warm process ends; its pid, lock and log stay beside the raylet's socket, where
    the run's stop looks for warm processes (jobs/cluster.py)."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    sockets = tmp_path / ("d" * 60) / "sockets"
    sockets.mkdir(parents=True)
    (tmp_path / "work").mkdir()
    raylet = subprocess.Popen(["sleep", "600"])
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "RAY_RAYLET_PID": str(raylet.pid),
           **SLOW_IMPORTS}
    try:
        run = launch(script, sockets / "raylet", tmp_path / "work", env)
        assert run.returncode == 7 and " forked " in run.stdout, run.stdout + run.stderr[-2000:]
        pid_file = next(sockets.glob("warm-raylet-*.pid"))
        warm = int(pid_file.read_text())
        assert launcher.warm_process_pids(str(sockets)) == [warm]
        address = launcher.socket_address(str(pid_file)[:-len(".pid")])
        assert address.startswith("/tmp/bertpipe-warm-") and Path(address).is_socket()
        assert {p.name for p in sockets.iterdir()} >= {pid_file.name, pid_file.stem + ".lock",
                                                       f"bertpipe-{pid_file.stem}.log"}
        raylet.kill()
        assert wait_for(lambda: not launcher.alive(warm)), "the warm process outlived its raylet"
        assert not list(Path("/tmp").glob(Path(address).name + "*")), "the warm process left its socket in /tmp"
        assert launcher.warm_process_pids(str(sockets)) == []
    finally:
        raylet.kill()
        raylet.wait()


def test_the_workers_keep_rays_own_start_when_off_or_when_the_job_picks_their_python(caplog):
    assert worker_runtime_env(False, {}) == {}
    assert worker_runtime_env(True, {"pip": ["x"]}) == {} and "the job's runtime env sets pip" in caplog.text
    on = worker_runtime_env(True, {"working_dir": "."})
    assert on == {"py_executable": f"{sys.executable} -m {LAUNCHER_MODULE}"}


SCRIPT = """
import os, sys
parent = open(f"/proc/{os.getppid()}/cmdline").read().replace("\\0", " ")
print("ran", os.environ.get("MINE"), os.getcwd(), "forked" if "zygote" in parent else "cold", os.getppid(),
      "torch" in sys.modules, sys.argv[1:], flush=True)
sys.exit(7)
"""


def launch(script, raylet, cwd, env):
    return subprocess.run([sys.executable, "-m", launcher.__name__, str(script), f"--raylet-name={raylet}"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def wait_for(condition, timeout_s=60.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


@pytest.mark.integration
def test_a_launch_is_a_fork_with_the_launchers_streams_environment_directory_and_exit_code(tmp_path):
    """The launcher with any script (Ray's worker script in production): forked from one warm process, which ends
    with its raylet; and where that process cannot start, the script runs cold, and later launches do not try
    again."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    # Short folders for the raylets' sockets: beside a long one (a deep pytest tmp_path) the warm process's socket
    # would go to /tmp instead (the deep-folder test above).
    sockets, sockets2 = (Path(tempfile.mkdtemp(prefix="bpw-", dir="/tmp")) for _ in range(2))
    (tmp_path / "work").mkdir()
    raylet = subprocess.Popen(["sleep", "600"])  # stands for the raylet: the warm process watches its pid
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, **SLOW_IMPORTS, "MINE": "kept",
           "RAY_RAYLET_PID": str(raylet.pid)}
    try:
        runs = [launch(script, sockets / "raylet", tmp_path / "work", env) for _ in range(2)]
        for run in runs:
            assert run.returncode == 7, run.stderr[-2000:]
            assert run.stdout.startswith(f"ran kept {tmp_path / 'work'} forked "), run.stdout
            assert run.stdout.endswith(f"True ['--raylet-name={sockets / 'raylet'}']\n"), run.stdout
        assert runs[0].stdout.split()[4] == runs[1].stdout.split()[4]  # the same warm process
        listening = lambda: [p for p in sockets.iterdir() if p.is_socket()]  # noqa: E731
        assert len(listening()) == 1
        raylet.kill()
        assert wait_for(lambda: not listening()), "the warm process outlived its raylet"
    finally:
        raylet.kill()
        raylet.wait()
        shutil.rmtree(sockets, ignore_errors=True)

    broken = tmp_path / "broken"
    (broken / "mlflow").mkdir(parents=True)
    (broken / "mlflow" / "__init__.py").write_text("raise ImportError('no MLflow here')\n")
    env["PYTHONPATH"] = f"{broken}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["RAY_worker_register_timeout_seconds"] = "1000"  # the launcher waits until the broken process has exited
    raylet = subprocess.Popen(["sleep", "600"])
    env["RAY_RAYLET_PID"] = str(raylet.pid)
    try:
        for _ in range(2):
            run = launch(script, sockets2 / "raylet", tmp_path / "work", env)
            assert run.returncode == 7 and " cold " in run.stdout, run.stdout + run.stderr[-2000:]
        failed = list(sockets2.glob("*.failed"))
        assert len(failed) == 1 and "exited before it was ready" in failed[0].read_text()
        assert "no MLflow here" in next(sockets2.glob("bertpipe-warm-*.log")).read_text()
    finally:
        raylet.kill()
        raylet.wait()
        shutil.rmtree(sockets2, ignore_errors=True)
