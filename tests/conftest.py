"""Shared fixtures: the real sample dumps (fetched through pip by the project), a local Ray, shared GLUE data."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = ["xdist_lanes"]  # how the suite's tests share the cores under `make test`'s pytest-xdist


@pytest.fixture(autouse=True)
def _mlflow_tracking_uri_left_as_found():
    """`mlflow.set_tracking_uri` also writes MLFLOW_TRACKING_URI into this process's environment, which the
    workflow reads: a test that loaded a model through the registry once sent every later in-process run's
    MLflow records to another store. Whatever a test sets, the next one starts from what was there before."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if os.environ.get("MLFLOW_TRACKING_URI") == before:
        return
    import mlflow

    mlflow.set_tracking_uri(None)  # unsets the variable too
    if before is not None:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture(scope="session")
def sample_dumps() -> dict[str, Path]:
    """The three real sample dumps from the gensim 4.4.0 wheel (downloaded once by `bertpipe fetch-sample`)."""
    from bertpipe.pipeline.stages.sample import fetch_sample

    return {name: path.resolve() for name, path in fetch_sample(REPO / "data" / "sample").items()}


@pytest.fixture(scope="session")
def enwiki_sample(sample_dumps) -> Path:
    return sample_dumps["enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"]


@pytest.fixture(scope="session")
def shared_glue_dir() -> Path:
    path = SHARED_DATA / "glue"
    if not path.is_dir():
        pytest.skip(f"real GLUE sample not present at {path} (../shared/data is only on developer machines)")
    return path


@pytest.fixture(scope="session")
def fault_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="session")
def ray_local(fault_dir):
    """One local Ray for the whole test session: 4 logical CPUs so trainer workers never starve data tasks.
    Every worker process runs the test-only fault injector's setup hook (inert until a test arms a plan)."""
    import ray

    from fault_injection import FAULT_DIR_ENV

    if not ray.is_initialized():
        pythonpath = os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = {"TOKENIZERS_PARALLELISM": "false", FAULT_DIR_ENV: str(fault_dir), "PYTHONPATH": pythonpath}
        # address="local": this session's own, even while another test's cluster (the multi-node rig, on the other
        # xdist worker) has written its address where a plain ray.init() looks first
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": env, "worker_process_setup_hook": "fault_injection.install"})
    yield ray
    ray.shutdown()


@pytest.fixture
def faults(fault_dir, ray_local):
    from fault_injection import Faults

    armed = Faults(fault_dir)
    yield armed
    armed.disarm()


@pytest.fixture(scope="session")
def real_pairs(tmp_path_factory, ray_local, enwiki_sample) -> Path:
    """A workdir with committed clean → vocab → pairs outputs built by the real workflow from the real enwiki
    sample, sized for fast pre-training tests: seq 64 shards only, a 4,000-piece vocabulary, two passes. The
    held-out share is 10% (13 of the 97 articles, ~1,500 instances) instead of 2% (3 articles, ~550): enough to
    measure MLM accuracy to a point, and not just the vocabulary of three articles."""
    from bertpipe.jobs import workflow
    from bertpipe.jobs.config import load_config

    workdir = tmp_path_factory.mktemp("real_pairs")
    overrides = [f"clean.input=[{enwiki_sample}]", "vocab.vocab_size=4000", "pairs.max_seq_lengths=[64]",
                 "pairs.dupe_factor=2", "pairs.num_shards=4", "pairs.heldout_fraction=0.1",
                 "mlflow.tracking_uri='off'"]  # quoted: YAML reads a bare off as false
    workflow.run(load_config("tiny", overrides, str(workdir)), only=["clean", "vocab", "pairs"])
    return workdir


# The tiny preset made short, for a whole workflow whose plumbing is under test, not its learning
# (tests/test_cluster_e2e.py's submitted run).
USER_RUN_SETTINGS = ["--set", "pretrain.max_steps=6", "--set", "pretrain.checkpoint_every_steps=3",
                     "--set", "pretrain.log_every_steps=2", "--set", "pretrain.eval_every_steps=0",
                     "--set", "glue.tasks=[MRPC]", "--set", "glue.learning_rates=[1e-4]",
                     "--set", "glue.num_epochs=1"]


def user_env(ray_tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["RAY_TMPDIR"] = str(ray_tmp)
    return env


@pytest.fixture(scope="session")
def clone(tmp_path_factory, sample_dumps):
    """A fresh clone of the tree under test, set up as `make setup` does, offline (tests/made_run.py)."""
    from made_run import new_clone

    dest = tmp_path_factory.mktemp("first-hour") / "bertpipe"
    why_not = new_clone(dest)
    if why_not:
        pytest.skip(why_not)
    return dest


@pytest.fixture(scope="session")
def made_run(clone):
    """The README's first command, `make run`, in that clone, once for the session: the one whole workflow run the
    tests that watch a user's run inspect (tests/test_first_hour.py, test_first_run.py, test_watching.py). Tests
    that change its workdir work on a copy."""
    from made_run import make_run

    with make_run(clone) as run:
        yield run
