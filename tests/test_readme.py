"""The docs cannot drift from the code: every command the READMEs show parses with the real CLI or exists.

The commands themselves run elsewhere: `make test` is CI, `make run` and the README's follow-up block after it
(`make status`, `make ui`, `. .venv/bin/activate`, `bertpipe status`) in test_first_hour.py (a fresh clone, a shell
without the venv on PATH), `bertpipe run/status/submit/jobs` run in
test_workflow.py and test_cluster_e2e.py, `bertpipe config` / `--version` / `submit` / `jobs` in test_cli_habits.py,
`infra/local/cluster.sh` in test_infra.py.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bertpipe.jobs.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "infra" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


# Code blocks that show what a program printed or a file holds, not commands to type.
NOT_COMMANDS = {"text", "console", "yaml", "json", "python"}


def _commands(prefix: str) -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        in_block, shown = False, False
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                in_block = not in_block
                shown = in_block and line[3:].strip() in NOT_COMMANDS
                continue
            text = line.split(" #", 1)[0].strip()
            if in_block and not shown and text.startswith(prefix):
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


def _bash_blocks(doc: Path) -> list[list[str]]:
    """Every ```bash block of `doc`, as its lines."""
    blocks, block = [], None
    for line in doc.read_text().splitlines():
        if block is None and line.strip() == "```bash":
            block = []
        elif block is not None and line.startswith("```"):
            blocks.append(block)
            block = None
        elif block is not None:
            block.append(line)
    return blocks


def _cluster_blocks() -> list[list[str]]:
    """The README's blocks that apply the RayJob (the first screen's and the cluster section's), comments dropped."""
    return [[line.split("   #", 1)[0].rstrip() for line in block] for block in _bash_blocks(REPO / "README.md")
            if any("infra/kuberay/rayjob.yaml" in line and "kubectl apply" in line for line in block)]


def test_the_first_screen_shows_the_cluster_path_as_its_section_does():
    """The five commands on the README's first screen are the section's, and they come before the first section."""
    first, *rest = _cluster_blocks()
    assert rest and all(block == first for block in rest), (first, rest)
    text = (REPO / "README.md").read_text()
    assert text.index("infra/kuberay/rayjob.yaml") < text.index("\n## ")
    steps = [line for line in first if not line.startswith("export ")]
    assert len(steps) == 5, steps


def test_the_readme_rayjob_substitution_leaves_no_change_me(tmp_path):
    """Step 4's sed, run on the manifest with an image and a bucket, leaves no CHANGE-ME and valid YAML whose
    images, workdir and checkpoint storage are the user's."""
    sed = next(line for line in _cluster_blocks()[0] if line.startswith("sed "))
    command = sed.split(" | kubectl", 1)[0]
    env = {**os.environ, "IMAGE": "registry.example/me/bertpipe:9.9.9", "BUCKET": "my-bucket"}
    out = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    assert "CHANGE-ME" not in out
    job = yaml.safe_load(out)
    spec = job["spec"]
    pods = [spec["submitterPodTemplate"], spec["rayClusterSpec"]["headGroupSpec"]["template"],
            *(group["template"] for group in spec["rayClusterSpec"]["workerGroupSpecs"])]
    assert {c["image"] for pod in pods for c in pod["spec"]["containers"]} == {env["IMAGE"]}
    assert "--workdir s3://my-bucket/" in spec["entrypoint"]


def _cost_table_output() -> str:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cost_table.py")], capture_output=True,
                          text=True, check=True, timeout=120)
    return done.stdout


def test_the_readme_cost_table_is_the_scripts_output():
    """README "What a real run costs" shows exactly the table benchmarks/cost_table.py prints."""
    table = [line for line in _cost_table_output().splitlines() if line.startswith("|")]
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## What a real run costs"):]
    section = section[:section.index("\n## ", 1)]
    shown = [line for line in section.splitlines() if line.startswith("|")]
    assert shown == table, "\n".join(table)
