"""The docs cannot drift from the code: every command the READMEs show parses with the real CLI or exists.

The commands themselves run elsewhere: `make test` is CI, `make run` and the README's follow-up block after it
(`make status`, `make ui`, `. .venv/bin/activate`, `bertpipe status`) in test_first_hour.py (a fresh clone, a shell
without the venv on PATH), `bertpipe run/status/submit/jobs` run in
test_workflow.py and test_cluster_e2e.py, `bertpipe config` / `--version` / `submit` / `jobs` in test_cli_habits.py,
`infra/local/cluster.sh` in test_infra.py.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from bertpipe.jobs.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "infra" / "README.md"]


def _commands(prefix: str) -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        in_block = False
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                in_block = not in_block
                continue
            text = line.split(" #", 1)[0].strip()
            if in_block and text.startswith(prefix):
                out.append((doc.name, text))
    return out


def test_readme_starts_with_the_two_commands():
    lines = [l for l in (REPO / "README.md").read_text().splitlines() if l.strip()]
    block = lines[lines.index("```bash") + 1:][:2]
    assert [l.split("#")[0].strip() for l in block] == ["make run", "make test"]
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in ci


@pytest.mark.parametrize("doc,command", _commands("bertpipe "))
def test_every_bertpipe_command_in_the_docs_parses(doc, command):
    argv = shlex.split(command)[1:]
    argv = [a.replace("JOB_ID", "raysubmit_x") for a in argv]
    if argv in (["--version"], ["--help"]):  # argparse answers these itself, then exits 0
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args(argv)
        assert done.value.code == 0
        return
    args = build_parser().parse_args(argv)
    assert callable(args.func)


def test_make_targets_in_the_docs_exist():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    for doc, command in _commands("make "):
        assert command.split()[1] in targets, f"{doc}: {command}"


def test_every_make_command_in_the_readme_is_run_by_a_test():
    """`make run` / `make test` run in CI (.ci/run) and in test_first_hour.py; every other make command the README
    shows must be in its follow-up block, which test_first_hour.py runs in a clean shell."""
    from test_first_hour import readme_follow_up

    shown = {command for doc, command in _commands("make ") if doc == "README.md"}
    assert shown - {"make run", "make test"} <= set(readme_follow_up()), shown


def test_docs_name_existing_files():
    for doc in DOCS:
        for path in re.findall(r"`((?:infra|configs|jobs|pipeline|model|benchmarks|tests)/[\w./-]+)`", doc.read_text()):
            assert (REPO / path).exists() or (doc.parent / path).exists(), f"{doc.name} names missing {path}"
