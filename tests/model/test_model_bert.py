"""The model against transformers' BERT (same weights → same numbers) and the properties of our own
design choices. Odd sizes (batch 3, seq 7, vocab 99) so that a swapped dimension fails loudly."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from bertpipe.model import (PRESETS, BertConfig, BertForPreTraining, BertForSequenceClassification, BertModel,
                   hf_state_dict)
from bertpipe.model.bert import BertForQuestionAnswering, BertForTokenClassification

transformers = pytest.importorskip("transformers")

B, T, V = 3, 7, 99
TINY = BertConfig.preset("tiny", vocab_size=V)  # padded to 104 rows: pad rows exercised everywhere


def perturbed(model, seed=0):
    """Random non-trivial values everywhere (LayerNorm gains, biases), pad rows kept zero: a wrong name
    mapping or a dropped bias then changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        model_ = getattr(model, "bert", model)
        model_.embeddings.word_embeddings.weight[model_.config.vocab_size:].zero_()
        if hasattr(model, "mlm"):
            model.mlm.bias[model.config.vocab_size:].zero_()
    return model


def batch(seed=0, pad=True):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, V, (B, T), generator=g)
    token_type_ids = torch.zeros(B, T, dtype=torch.long)
    token_type_ids[:, 4:] = 1
    attention_mask = torch.ones(B, T, dtype=torch.long)
    if pad:  # rows of length 7, 5, 3
        attention_mask[1, 5:] = 0
        attention_mask[2, 3:] = 0
        input_ids = input_ids * attention_mask
        token_type_ids = token_type_ids * attention_mask
    return input_ids, token_type_ids, attention_mask


def hf_twin(model, hf_cls):
    hf_config = transformers.BertConfig(**model.config.to_hf_dict())
    kwargs = {"num_labels": model.num_labels} if hasattr(model, "num_labels") else {}
    if kwargs:
        hf_config.num_labels = kwargs["num_labels"]
    hf = hf_cls(hf_config).eval()
    result = hf.load_state_dict(hf_state_dict(model), strict=False)
    tied = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    assert set(result.missing_keys) <= tied and not result.unexpected_keys, result
    return hf


# ----------------------------------------------------------------------------------- config


def test_presets_and_config_errors():
    assert set(PRESETS) == {"tiny", "bert-tiny", "mini", "base", "large"}
    large = BertConfig.preset("large")
    assert (large.num_hidden_layers, large.hidden_size, large.num_attention_heads, large.intermediate_size) == \
        (24, 1024, 16, 4096)
    assert BertConfig.preset("base") == BertConfig()
    assert BertConfig.preset("mini", vocab_size=V).padded_vocab_size == 104
    with pytest.raises(ValueError, match="tiny, mini, base, large"):
        BertConfig.preset("huge")
    with pytest.raises(ValueError, match="hidden_sise"):
        BertConfig.preset("tiny", hidden_sise=3)
    with pytest.raises(ValueError, match="multiple"):
        BertConfig(hidden_size=100, num_attention_heads=3)
    with pytest.raises(TypeError):
        BertConfig(30522)  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.hidden_size = 3


def test_hf_config_round_trip():
    hf = transformers.BertConfig(**TINY.to_hf_dict())
    assert hf.model_type == "bert" and hf.vocab_size == V and hf.num_hidden_layers == 2
    assert BertConfig.from_hf_dict(hf.to_dict()) == TINY
    with pytest.raises(ValueError, match="relative_key"):
        BertConfig.from_hf_dict({**TINY.to_hf_dict(), "position_embedding_type": "relative_key"})


@pytest.mark.parametrize("name", ["tiny", "mini", "base"])
def test_parameter_count_equals_transformers(name):
    config = BertConfig.preset(name, pad_vocab_to_multiple_of=1)
    with torch.device("meta"):
        ours = sum(p.numel() for p in BertForPreTraining(config).parameters())
        hf = sum(p.numel() for p in transformers.BertForPreTraining(
            transformers.BertConfig(**config.to_hf_dict())).parameters())
        padded = sum(p.numel() for p in BertForPreTraining(dataclasses.replace(config, vocab_size=V)).parameters())
        unpadded = sum(p.numel() for p in BertForPreTraining(
            dataclasses.replace(config, vocab_size=V, pad_vocab_to_multiple_of=8)).parameters())
    assert ours == hf
    assert unpadded - padded == (104 - V) * (config.hidden_size + 1)  # embedding row + output bias per pad row
    if name == "base":
        assert 109e6 < ours < 111e6  # the paper's "110M"


# ------------------------------------------------------------------------ equal to transformers


@pytest.mark.parametrize("pad", [False, True])
def test_pretraining_matches_transformers(pad):
    ours = perturbed(BertForPreTraining(TINY)).eval()
    hf = hf_twin(ours, transformers.BertForPreTraining)
    ids, tt, am = batch(pad=pad)
    with torch.no_grad():
        out = ours(ids, tt, am)
        encoded = ours.bert(ids, tt, am)
        ref = hf(input_ids=ids, token_type_ids=tt, attention_mask=am, output_hidden_states=True)
        ref_pooled = hf.bert(input_ids=ids, token_type_ids=tt, attention_mask=am).pooler_output
    assert out.mlm_logits.shape == (B, T, V)
    for a, b in [(encoded.last_hidden_state, ref.hidden_states[-1]), (encoded.pooler_output, ref_pooled),
                 (out.mlm_logits, ref.prediction_logits),
                 (out.nsp_logits, ref.seq_relationship_logits)]:
        assert a.shape == b.shape
        assert (a - b).abs().max() <= 1e-5


def test_padding_never_changes_real_positions():
    model = perturbed(BertModel(TINY)).eval()
    ids, tt, _ = batch(pad=False)
    short = ids[:, :5], tt[:, :5], torch.ones(B, 5, dtype=torch.long)
    padded_ids = torch.cat([ids[:, :5], torch.zeros(B, 2, dtype=torch.long)], 1)
    padded = padded_ids, torch.cat([tt[:, :5], torch.zeros(B, 2, dtype=torch.long)], 1), \
        (padded_ids != 0).long().index_fill(1, torch.arange(5), 1)
    with torch.no_grad():
        plain, with_pads = model(*short), model(*padded)
    assert (plain.last_hidden_state - with_pads.last_hidden_state[:, :5]).abs().max() <= 1e-6
    assert (plain.pooler_output - with_pads.pooler_output).abs().max() <= 1e-6


def test_all_pad_row_gives_no_nan():
    model = BertForPreTraining(TINY).eval()
    ids, tt, am = batch()
    am[2] = 0
    with torch.no_grad():
        out = model(ids, tt, am)
    assert torch.isfinite(out.mlm_logits).all() and torch.isfinite(out.nsp_logits).all()


@pytest.mark.parametrize("cls,hf_name,kwargs", [
    (BertForSequenceClassification, "BertForSequenceClassification", {"num_labels": 3}),
    (BertForSequenceClassification, "BertForSequenceClassification", {"num_labels": 1}),
    (BertForTokenClassification, "BertForTokenClassification", {"num_labels": 5}),
    (BertForQuestionAnswering, "BertForQuestionAnswering", {}),
])
def test_task_heads_match_transformers(cls, hf_name, kwargs):
    ours = perturbed(cls(TINY, **kwargs)).eval()
    hf = hf_twin(ours, getattr(transformers, hf_name))
    ids, tt, am = batch()
    g = torch.Generator().manual_seed(1)
    if cls is BertForQuestionAnswering:
        labels = dict(start_positions=torch.tensor([1, 2, 9]), end_positions=torch.tensor([3, 2, 9]))  # 9: outside
    elif cls is BertForTokenClassification:
        labels = dict(labels=torch.randint(0, 5, (B, T), generator=g).masked_fill(am == 0, -100))
    elif kwargs["num_labels"] == 1:
        labels = dict(labels=torch.rand(B, generator=g) * 5)
    else:
        labels = dict(labels=torch.randint(0, 3, (B,), generator=g))
    with torch.no_grad():
        out = ours(ids, tt, am, **labels)
        ref = hf(input_ids=ids, token_type_ids=tt, attention_mask=am, **labels)
    # the same field names as transformers' outputs, so each is compared by name
    names = ("start_logits", "end_logits") if cls is BertForQuestionAnswering else ("logits",)
    assert out._fields == ("loss", *names)
    for name in names:
        a, b = getattr(out, name), getattr(ref, name)
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-5
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-5


# -------------------------------------------------------------------------------- our choices


def test_masked_position_loss_equals_full_projection_by_hand():
    model = perturbed(BertForPreTraining(TINY)).eval()
    ids, tt, am = batch()
    positions = torch.tensor([[1, 4, 6, 0], [2, 3, 0, 0], [1, 0, 0, 0]])  # pad slots 0
    labels = torch.tensor([[5, 17, 98, -100], [0, 42, -100, -100], [7, -100, -100, -100]])
    nsp_labels = torch.tensor([0, 1, 1])
    with torch.no_grad():
        out = model(ids, tt, am, positions, labels, nsp_labels)
        full = model(ids, tt, am).mlm_logits  # [B, T, V]
    full_labels = torch.full((B, T), -100).scatter(1, positions, labels)
    full_labels[:, 0] = -100  # slot position 0 carries only pads here
    expected = F.cross_entropy(full.reshape(-1, V), full_labels.flatten(), ignore_index=-100)
    assert out.mlm_logits.shape == (B, 4, V)
    assert abs(out.mlm_loss.item() - expected.item()) <= 1e-6
    assert abs(out.nsp_loss.item() - F.cross_entropy(out.nsp_logits, nsp_labels).item()) <= 1e-6
    assert out.loss.item() == pytest.approx(out.mlm_loss.item() + out.nsp_loss.item(), abs=1e-6)
    assert out.mlm_count.item() == 6
    hits = (full.argmax(-1).gather(1, positions) == labels) & (labels != -100)
    assert out.mlm_correct.item() == hits.sum().item()
    assert out.nsp_correct.item() == (out.nsp_logits.argmax(-1) == nsp_labels).sum().item()


def test_no_labels_no_loss_and_empty_mask_no_nan():
    model = BertForPreTraining(TINY)
    ids, tt, am = batch()
    out = model(ids, tt, am, torch.zeros(B, 2, dtype=torch.long))
    assert out.loss is None and out.mlm_loss is None and out.mlm_logits.shape == (B, 2, V)
    out = model(ids, tt, am, torch.zeros(B, 2, dtype=torch.long), torch.full((B, 2), -100))
    assert out.mlm_loss.item() == 0.0 and out.mlm_count.item() == 0


def test_pad_rows_never_predicted_nor_trained():
    model = BertForPreTraining(TINY)
    assert model.bert.embeddings.word_embeddings.weight.shape == (104, 64)
    assert model.mlm.decoder_weight is model.bert.embeddings.word_embeddings.weight  # tied
    ids, tt, am = batch()
    out = model(ids, tt, am, torch.tensor([[1, 2]] * B), torch.tensor([[3, 4]] * B), torch.tensor([0, 1, 0]))
    out.loss.backward()
    assert out.mlm_logits.shape[-1] == V
    assert model.bert.embeddings.word_embeddings.weight.grad[V:].abs().max() == 0
    assert model.mlm.bias.grad[V:].abs().max() == 0


def test_activation_checkpointing_same_gradients():
    ids, tt, am = batch()
    args = (ids, tt, am, torch.tensor([[1, 2]] * B), torch.tensor([[3, 4], [5, -100], [6, 7]]),
            torch.tensor([0, 1, 0]))
    grads = []
    for flag in (False, True):
        torch.manual_seed(0)
        model = BertForPreTraining(dataclasses.replace(TINY, activation_checkpointing=flag)).train()
        torch.manual_seed(1)  # same dropout masks in both runs (checkpoint replays the RNG state)
        model(*args).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=1e-6, msg=name)


def test_deterministic_init_truncated_normal():
    torch.manual_seed(0)
    a = BertForPreTraining(TINY)
    torch.manual_seed(0)
    b = BertForPreTraining(TINY)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    w = a.bert.encoder.layers[0].ffn.fc1.weight
    assert w.abs().max() <= 0.04 and 0.015 < w.std() < 0.02  # cut at 2 std → std ≈ 0.88 × 0.02


def test_bf16_autocast_runs_with_fp32_layernorm_and_loss():
    model = BertForPreTraining(TINY)
    ids, tt, am = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, tt, am, torch.tensor([[1, 2]] * B), torch.tensor([[3, 4]] * B), torch.tensor([0, 1, 0]))
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    bf16 = BertForPreTraining(TINY).to(torch.bfloat16)  # pure bf16 weights, as DeepSpeed bf16 does
    out = bf16(ids, tt, am, torch.tensor([[1, 2]] * B), torch.tensor([[3, 4]] * B), torch.tensor([0, 1, 0]))
    assert out.mlm_logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_autocast_all_pad_row_finite(dtype):
    model = BertForPreTraining(TINY).eval()
    ids, tt, am = batch()
    am[2] = 0  # a filler row: no real key at all
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        out = model(ids, tt, am)
    assert torch.isfinite(out.mlm_logits.float()).all() and torch.isfinite(out.nsp_logits.float()).all()


def test_too_long_sequence_is_a_clear_error():
    model = BertModel(dataclasses.replace(TINY, max_position_embeddings=6))
    with pytest.raises(ValueError, match="max_position_embeddings 6"):
        model(*batch())


@pytest.mark.parametrize("cls,kwargs", [(BertModel, {}), (BertForSequenceClassification, {"num_labels": 3}),
                                        (BertForTokenClassification, {"num_labels": 4}),
                                        (BertForQuestionAnswering, {})])
def test_named_outputs_trace_whole_under_torch_compile(cls, kwargs):
    """Each head's named output passes through torch.compile as one graph (fullgraph: a break would raise) and
    keeps its type and field names; the compiled model computes what the eager one does."""
    model = perturbed(cls(TINY, **kwargs)).eval()
    ids, tt, am = batch()
    with torch.no_grad():
        eager = model(ids, tt, am)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=True)(ids, tt, am)
    assert type(compiled) is type(eager) and compiled._fields == eager._fields
    for a, b in zip(eager, compiled, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
