"""Sentence splitter on hand-picked hard cases and on the real enwiki sample."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _clean_docs import crude_docs  # noqa: E402

from bertpipe.pipeline.stages.sentences import split_sentences  # noqa: E402


@pytest.mark.parametrize("text,expected", [
    ("Dr. Smith arrived. He sat down.", ["Dr. Smith arrived.", "He sat down."]),
    ("The U.S. Army grew. It was 1942.", ["The U.S. Army grew.", "It was 1942."]),
    ("Pi is about 3.14 in value. Next.", ["Pi is about 3.14 in value.", "Next."]),
    ("Tools, e.g. hammers, help. Use them.", ["Tools, e.g. hammers, help.", "Use them."]),
    ("J. R. R. Tolkien wrote it. Franklin D. Roosevelt read it.",
     ["J. R. R. Tolkien wrote it.", "Franklin D. Roosevelt read it."]),
    ('"Really?" she asked. "Yes!" He left.', ['"Really?" she asked.', '"Yes!"', "He left."]),
    ("See Fig. 3 and No. 5 here. Done (mostly). Then 1990 came.",
     ["See Fig. 3 and No. 5 here.", "Done (mostly).", "Then 1990 came."]),
    ("One paragraph ends\nAnother starts. Here.", ["One paragraph ends", "Another starts.", "Here."]),
])
def test_hard_cases(text, expected):
    assert split_sentences(text) == expected


def test_real_sample_sentences_are_plausible(enwiki_sample):
    docs = crude_docs(enwiki_sample)
    sentences = [s for d in docs for s in split_sentences(d["text"])]
    assert len(sentences) > 5_000
    # Nothing is lost: the splitter only cuts at whitespace.
    for d in docs[:20]:
        joined = "".join("".join(split_sentences(d["text"])).split())
        assert joined == "".join(d["text"].split())
    # Few "sentences" end right after a known abbreviation or an initial (false splits).
    bad = [s for s in sentences if s.endswith((" Dr.", " Mr.", " St.", " U.S.")) and len(s) < 30]
    assert len(bad) < len(sentences) * 0.002
    ends = sum(s.rstrip("\"')”’").endswith((".", "!", "?")) for s in sentences)
    assert ends / len(sentences) > 0.9
