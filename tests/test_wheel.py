"""The wheel carries the product: built from the tree under test and installed into a new venv outside any checkout,
`bertpipe fetch-sample` then `bertpipe run --config tiny` in an empty folder run the whole workflow, the preset
coming from the wheel's package data.

The venv holds the wheel alone (pip install --no-deps --no-index) over the dependencies of this test environment,
reached through a folder of links to its site-packages that leaves out everything of bertpipe (the editable
install's finder and metadata): a module or preset the wheel lacks is not found anywhere else. The source copy the
wheel was built from is deleted before anything runs. fetch-sample takes the gensim wheel through pip as always,
from this checkout's data/downloads when a test session already fetched it (offline), else from PyPI.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
from conftest import REPO, USER_RUN_SETTINGS

pytestmark = pytest.mark.integration

SOURCES = ("pyproject.toml", "README.md", "pipeline", "model", "jobs", "configs")
STAGES = ("clean", "vocab", "pairs", "pretrain", "glue")


def build_wheel(into: Path) -> Path:
    """The wheel of the tree under test (its product files, copied: the build writes build/ and egg-info beside
    its sources, never into the checkout)."""
    src = into / "src"
    src.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        (shutil.copytree(REPO / name, src / name, ignore=skip) if (REPO / name).is_dir()
         else shutil.copy2(REPO / name, src / name))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--quiet", "-w", str(into / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.rmtree(src)
    (wheel,) = (into / "dist").glob("bertpipe-*.whl")
    return wheel


def venv_with(wheel: Path, venv: Path) -> None:
    """A venv of this Python whose only bertpipe is `wheel`; the dependencies are this environment's, linked."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                   "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    stack = venv.parent / "stack"
    stack.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("bertpipe", "__editable__")):
            (stack / entry.name).symlink_to(entry)
    # A path line, not a site dir: the linked folder's own .pth files do not run.
    (purelib / "_test_stack.pth").write_text(f"{stack}\n")
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def user_shell(venv: Path, ray_tmp: Path) -> dict[str, str]:
    """A shell with the new venv on PATH and nothing of this test session: no checkout venv, no PYTHONPATH, no Ray
    or MLflow address."""
    drop = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "RAY_ADDRESS", "MLFLOW_TRACKING_URI"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    here = Path(sys.executable).parent.resolve()
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != here]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    env["RAY_TMPDIR"] = str(ray_tmp)
    gensim = sorted((REPO / "data" / "downloads").glob("gensim-4.4.0-*.whl"))
    if gensim:  # pip finds it there, offline
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(gensim[0].parent))
    return env


def where_from(venv: Path, cwd: Path, env: dict[str, str]) -> dict:
    code = ("import json, sys, bertpipe.jobs.cli as cli, bertpipe.jobs.config as c; "
            "print(json.dumps({'cli': cli.__file__, 'preset': str(c.find_preset('tiny')), "
            "'as_in_the_readme': str(c.find_preset('configs/tiny.yaml')), 'path': sys.path}))")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(proc.stdout)


def test_the_wheel_alone_runs_the_workflow_in_an_empty_folder(tmp_path):
    wheel = build_wheel(tmp_path / "build")
    venv = tmp_path / "env" / "venv"
    venv_with(wheel, venv)
    empty = tmp_path / "empty"
    empty.mkdir()
    ray_tmp = Path(tempfile.mkdtemp(prefix="bpwh-", dir="/tmp"))  # Ray's socket paths must stay short
    env = user_shell(venv, ray_tmp)
    try:
        found = where_from(venv, empty, env)
        assert found["preset"] == found["as_in_the_readme"]  # `--config tiny` and `--config configs/tiny.yaml`
        for path in (found["cli"], found["preset"]):
            assert Path(path).is_relative_to(venv) and not Path(path).resolve().is_relative_to(REPO), path
        assert not any(p and Path(p).resolve().is_relative_to(REPO) for p in found["path"]), found["path"]

        fetched = subprocess.run(["bertpipe", "fetch-sample"], cwd=empty, env=env, capture_output=True, text=True,
                                 timeout=600)
        assert fetched.returncode == 0, fetched.stderr[-3000:]
        run = subprocess.run(["bertpipe", "run", "--config", "tiny", *USER_RUN_SETTINGS], cwd=empty, env=env,
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)

    workdir = empty / "work" / "tiny"  # the preset's relative workdir, under the folder the user is in
    for stage in STAGES:
        manifest = json.loads((workdir / stage / "_MANIFEST.json").read_text())
        assert manifest["files"] and all((workdir / stage / f["path"]).is_file() for f in manifest["files"]), stage
    clean = json.loads((workdir / "clean" / "_MANIFEST.json").read_text())
    assert [Path(d["uri"]).parent for d in clean["raw_inputs"]] == [empty / "data" / "sample"]
    pretrain = json.loads((workdir / "pretrain" / "_MANIFEST.json").read_text())
    assert {"export/README.md", "export/tokenizer.json"} <= set(pretrain["outputs"])
    assert "bertpipe run --config tiny" in (workdir / "pretrain" / "export" / "README.md").read_text()
