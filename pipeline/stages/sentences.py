"""Rule-based sentence segmentation for clean Wikipedia prose (pure, no model, no Ray).

The original BERT data generator expects one sentence per line and leaves the splitting to the user (the paper's
authors used spaCy-like tooling). A statistical splitter is overkill for encyclopedic text and costs more than the
tokenizer, so this is a single regex scan plus a few rules:

- a boundary is `.`, `!` or `?` (optionally followed by closing quotes/brackets), then whitespace, then something
  that can open a sentence (an upper-case letter, a digit, an opening quote or bracket);
- no boundary after a title or reference abbreviation that never ends a sentence in practice ("Dr.", "St.", "No.",
  "Fig.", "vs."), after a single initial ("J. R. R. Tolkien") or after a dotted acronym ("U.S.", "e.g.", "Ph.D."):
  "the U.S. Army" is far more common in Wikipedia than a sentence ending in "U.S.";
- decimals ("3.14"), versions and URLs never qualify because no whitespace follows the dot;
- a newline (paragraph break of the clean stage) is always a boundary.
"""
from __future__ import annotations

import re

# Abbreviations that are followed by a name or number, so a capital after them does not open a new sentence.
# Lower-cased, without the final dot. Deliberately excludes "Inc", "Ltd", "Co", "etc", "Jr": those end
# sentences often enough that splitting after them is the better bet.
NON_TERMINAL_ABBREVIATIONS = frozenset(
    """
    mr mrs ms mssrs messrs dr prof rev hon st ste mt ft gen col lt sgt capt cpt cmdr adm maj brig gov sen rep pres
    supt insp fr sr br mme mlle no nos fig figs vol vols ch chap art sec p pp para vs v cf ca approx est op ed eds
    jan feb mar apr jun jul aug sep sept oct nov dec
    """.split()
)

# Candidate boundary: terminal punctuation, any closing quotes/brackets, then whitespace (not a newline: the
# paragraph split already happened).
_CANDIDATE = re.compile(r"[.!?]+[\"'\)\]’”»]*[ \t\u00a0]+")
# The word that carries a dot right before the candidate, e.g. "Dr" in "Dr. ", "U.S" in "U.S. ".
_WORD_BEFORE = re.compile(r"([\w.\-']+)\.$")
_OPENERS = "\"'(“‘[«¿¡"


def _is_boundary(text: str, start: int, end: int) -> bool:
    """Whether the candidate text[start:end] (punctuation + spaces) really ends a sentence."""
    if end >= len(text):
        return False
    nxt = text[end]
    if nxt in _OPENERS and end + 1 < len(text):
        nxt = text[end + 1]
    if not (nxt.isupper() or nxt.isdigit()):
        return False  # "e.g. the", "approx. 3" is handled below, lowercase never opens a sentence here
    punct = text[start:end].rstrip()
    if not punct.startswith(".") or punct.startswith(".."):
        return True  # "!" "?" and ellipses always split when a capital follows
    match = _WORD_BEFORE.search(text, max(0, start - 40), start + 1)
    if match is None:
        return True
    word = match.group(1)
    if "." in word.strip("."):
        return False  # dotted acronym: "U.S.", "e.g.", "Ph.D."
    if len(word) == 1 and word.isalpha():
        return False  # initial: "J. R. R. Tolkien", "Franklin D. Roosevelt"
    return word.lower() not in NON_TERMINAL_ABBREVIATIONS


def split_paragraph(paragraph: str) -> list[str]:
    """Sentences of one paragraph, stripped, empty ones dropped."""
    sentences = []
    begin = 0
    for m in _CANDIDATE.finditer(paragraph):
        if _is_boundary(paragraph, m.start(), m.end()):
            sentence = paragraph[begin:m.end()].strip()
            if sentence:
                sentences.append(sentence)
            begin = m.end()
    tail = paragraph[begin:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def split_sentences(text: str) -> list[str]:
    """Sentences of a clean document in reading order; paragraphs are separated by "\\n"."""
    out: list[str] = []
    for paragraph in text.split("\n"):
        if paragraph.strip():
            out.extend(split_paragraph(paragraph))
    return out
