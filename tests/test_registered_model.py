"""The registered pre-trained model is code plus weights, not a pickle: it registers with a signature, a
description, the version's tags and the alias `newest`, and loads through mlflow.pyfunc from its safetensors,
config and vocabulary, giving [CLS]'s hidden state as transformers' BertModel does, also in a Python where
bertpipe cannot be imported."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

import numpy as np
import pandas as pd
import torch

from bertpipe.jobs.pretrain.stage import MODEL_DESCRIPTION, register
from bertpipe.jobs.services.tracking import MODEL_ALIAS, RunLogger
from bertpipe.model import BertConfig, BertForPreTraining, save_pretrained
from bertpipe.pipeline.formats.tokenizer import tokenizer_files
from conftest import REPO
from pretrain_helpers import TOKENS

ROWS = [[2, 10, 11, 3, 12, 3], [2, 20, 3, 21, 22, 23, 3]]

# Run with `python -S`: site-packages is put on sys.path as a plain folder, so no .pth file runs and bertpipe's
# editable install (a .pth import hook) is not there; the current folder is a temporary one, not the repo.
WITHOUT_BERTPIPE = """
import sys
sys.path.append(sys.argv[1])
try:
    import bertpipe
except ImportError:
    pass
else:
    raise SystemExit(f"bertpipe is importable from {bertpipe.__path__}")
import os
assert sys.argv[4] not in [os.path.abspath(p or ".") for p in sys.path], sys.path  # the repo is not on the path
import numpy as np, pandas as pd, mlflow.pyfunc
model = mlflow.pyfunc.load_model(sys.argv[2])
np.save(sys.argv[3], model.predict(pd.DataFrame({"input_ids": %r})))
print("loaded without bertpipe:", sorted(m for m in sys.modules if m.startswith("bertpipe")))
""" % (ROWS,)


def _export(tmp_path, seed: int):
    torch.manual_seed(seed)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=len(TOKENS))).eval()
    (tmp_path / "vocab.txt").write_text("\n".join(TOKENS) + "\n")
    out = tmp_path / f"export{seed}"
    save_pretrained(model, str(out), str(tmp_path / "vocab.txt"), tokenizer_files=tokenizer_files(True, 512))
    return out


def test_registered_export_has_no_pickle_and_loads_without_bertpipe(tmp_path):
    import mlflow
    import transformers
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("reg", artifact_location=str(tmp_path / "artifacts"))
    versions = []
    for seed in (0, 1):  # two pre-trainings: the alias follows the newer version
        run = client.create_run(exp)
        logger = RunLogger({"tracking_uri": uri, "run_id": run.info.run_id, "experiment_id": exp})
        tags = {"bertpipe.config": "tiny", "bertpipe.data": f"pairs-{seed}", "bertpipe.git_commit": "abc1234"}
        assert register(logger, str(_export(tmp_path, seed)), "bertpipe-test", f"version from seed {seed}", tags)
        versions.append(client.get_model_version_by_alias("bertpipe-test", MODEL_ALIAS))

    first, newest = versions
    assert (int(first.version), int(newest.version)) == (1, 2)
    assert client.get_registered_model("bertpipe-test").description == MODEL_DESCRIPTION
    assert "\n" not in MODEL_DESCRIPTION.split("\n\n")[0]  # MLflow's Markdown: one line per paragraph
    assert newest.description == "version from seed 1"
    assert newest.tags == {"bertpipe.config": "tiny", "bertpipe.data": "pairs-1", "bertpipe.git_commit": "abc1234"}
    assert {k: int(v) for k, v in client.get_registered_model("bertpipe-test").aliases.items()} == {MODEL_ALIAS: 2}

    files = [p for p in (tmp_path / "artifacts").rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"model.safetensors", "config.json", "vocab.txt", "MLmodel", "pyfunc_model.py"} <= names
    assert not [p for p in files if p.suffix in (".pkl", ".pickle", ".pth", ".pt")], names
    mlflow.set_tracking_uri(uri)  # conftest puts it (and the environment it writes) back after the test
    loaded = mlflow.pyfunc.load_model(f"models:/bertpipe-test@{MODEL_ALIAS}")
    assert loaded.metadata.get_input_schema().input_names() == ["input_ids"]
    got = loaded.predict(pd.DataFrame({"input_ids": ROWS}))
    hf = transformers.BertModel.from_pretrained(str(tmp_path / "export1")).eval()
    with torch.no_grad():
        want = np.stack([hf(input_ids=torch.tensor([r])).last_hidden_state[0, 0].numpy() for r in ROWS])
    assert got.shape == (2, 64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    # The same model in a Python that cannot import bertpipe: the code MLflow keeps with the model is enough.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env["MLFLOW_TRACKING_URI"] = uri
    proc = subprocess.run([sys.executable, "-S", "-c", WITHOUT_BERTPIPE, sysconfig.get_paths()["purelib"],
                           f"models:/bertpipe-test@{MODEL_ALIAS}", str(tmp_path / "out.npy"), str(REPO)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded without bertpipe: []" in proc.stdout, proc.stdout
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), want, rtol=1e-4, atol=1e-5)
