"""The registered pre-trained model as MLflow loads it: code, not a pickle.

`tracking.RunLogger.log_export` logs this file as an MLflow "model from code" with the export folder
(model.safetensors + config.json + vocab.txt, Hugging Face layout) as its artifact. Loading runs this file and reads
the weights with transformers' BertForPreTraining: no pickle is ever unpickled, and nothing of bertpipe is needed
to load it (`mlflow.pyfunc.load_model("models:/<name>@newest")`, the alias of the newest version): this file imports
nothing but MLflow, and MLflow keeps a copy of it with the model (tests/test_registered_model.py loads one where
`import bertpipe` fails).

predict: rows with `input_ids` (WordPiece ids of `[CLS] … [SEP]`, vocab.txt beside the weights) → the final hidden
state of [CLS] of each row, float32 [rows, hidden_size].
"""
from __future__ import annotations

import mlflow


class BertExport(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        import transformers

        self.model = transformers.BertForPreTraining.from_pretrained(context.artifacts["export"]).eval()

    def predict(self, context, model_input, params=None):
        import numpy as np
        import torch

        rows = model_input["input_ids"]
        rows = [list(map(int, r)) for r in (rows.tolist() if hasattr(rows, "tolist") else rows)]
        out = []
        with torch.no_grad():
            for ids in rows:
                hidden = self.model.bert(input_ids=torch.tensor([ids])).last_hidden_state
                out.append(hidden[0, 0].float().numpy())
        return np.stack(out)


mlflow.models.set_model(BertExport())
