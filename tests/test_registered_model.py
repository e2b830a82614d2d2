"""The registered pre-trained model is code plus weights, not a pickle: it registers with a signature and loads
through mlflow.pyfunc from its safetensors, config and vocabulary, giving [CLS]'s hidden state as transformers'
BertModel does."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from bertpipe.jobs.pretrain.stage import register
from bertpipe.jobs.tracking import RunLogger
from bertpipe.model import BertConfig, BertForPreTraining, save_pretrained
from pretrain_helpers import TOKENS


def test_registered_export_has_no_pickle_and_loads_from_weights(tmp_path):
    import mlflow
    import transformers
    from mlflow.tracking import MlflowClient

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=len(TOKENS))).eval()
    (tmp_path / "vocab.txt").write_text("\n".join(TOKENS) + "\n")
    save_pretrained(model, str(tmp_path / "export"), str(tmp_path / "vocab.txt"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("reg", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(exp)
    logger = RunLogger({"tracking_uri": uri, "run_id": run.info.run_id, "experiment_id": exp})
    model_uri = register(logger, str(tmp_path / "export"), "bertpipe-test")
    assert model_uri

    version = client.search_model_versions("name='bertpipe-test'")[0]
    files = [p for p in (tmp_path / "artifacts").rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"model.safetensors", "config.json", "vocab.txt", "MLmodel"} <= names
    assert not [p for p in files if p.suffix in (".pkl", ".pickle", ".pth", ".pt")], names
    mlflow.set_tracking_uri(uri)  # conftest puts it (and the environment it writes) back after the test
    loaded = mlflow.pyfunc.load_model(f"models:/bertpipe-test/{version.version}")
    assert loaded.metadata.get_input_schema().input_names() == ["input_ids"]
    rows = [[2, 10, 11, 3, 12, 3], [2, 20, 3, 21, 22, 23, 3]]
    got = loaded.predict(pd.DataFrame({"input_ids": rows}))
    hf = transformers.BertModel.from_pretrained(str(tmp_path / "export")).eval()
    with torch.no_grad():
        want = np.stack([hf(input_ids=torch.tensor([r])).last_hidden_state[0, 0].numpy() for r in rows])
    assert got.shape == (2, 64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
