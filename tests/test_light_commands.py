"""`bertpipe status` answers in about a second: it fingerprints every stage (the opt-in ones too) but imports none of
what the stages train with (torch, DeepSpeed, SciPy, scikit-learn, Ray Train, smart_open), which each stage module
loads only when the stage runs. The same holds for the planning a run does before it starts anything, so a run
that skips every stage pays for none of them either.
"""
from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "deepspeed", "scipy", "sklearn", "ray.train", "ray.data", "smart_open")

# Runs the command in a fresh interpreter, then prints which heavy modules it left imported.
PROBE = f"""
import json, sys
from bertpipe.jobs.cli import main
code = main(sys.argv[1:])
print("\\nLOADED " + json.dumps([m for m in {HEAVY!r} if m in sys.modules]))
sys.exit(code)
"""


def loaded_by(args: list[str], cwd) -> tuple[subprocess.CompletedProcess, list[str]]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("LOADED ")]
    assert line, (proc.stdout[-2000:], proc.stderr[-2000:])
    return proc, json.loads(line[-1].removeprefix("LOADED "))


def test_status_of_every_stage_imports_no_training_library(tmp_path):
    proc, loaded = loaded_by(["status", "--config", "tiny", "--workdir", str(tmp_path / "w"), "--json"], tmp_path)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]  # 1: stages missing, as they are in an empty workdir
    states = {r["stage"]: r["state"] for r in json.loads(proc.stdout.split("\nLOADED ")[0])}
    assert {"clean", "vocab", "pairs", "pretrain", "glue"} <= set(states) and set(states.values()) == {"missing"}
    assert loaded == [], loaded


def test_the_probe_sees_a_module_that_is_imported(tmp_path):
    """The check above can fail: a command that imports torch is reported as having loaded it."""
    code = PROBE.replace("code = main(sys.argv[1:])", "import torch; code = 0")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert json.loads(proc.stdout.split("LOADED ")[-1]) == ["torch"]
