"""Reading and writing the CoNLL column format (CoNLL-2003: `token POS chunk NER` a line, a blank line between
sentences, `-DOCSTART- ...` lines between documents).

Tags are O, B-TYPE or I-TYPE in IOB1 (B- only between two adjacent entities of one type) or IOB2 (every entity
starts with B-); "auto" calls a file IOB1 when some entity starts with I- (after O, after another type, or at
a sentence start), else IOB2. Training uses IOB2 labels; the scheme only changes how the tags are read.
Errors name the file and line: a line whose column count differs from the file's first token line, a tag that
is not O / B-T / I-T with T one of the configured entity types.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.stage import StageInputError

DOCSTART = "-DOCSTART-"


@dataclass
class Sentence:
    words: list[str]
    tags: list[str]  # as in the file
    line: int = 0  # 1-based line of its first word


@dataclass
class ConllFile:
    uri: str
    sentences: list[Sentence] = field(default_factory=list)
    num_documents: int = 0
    scheme: str = "iob2"
    num_columns: int = 0


def split_tag(tag: str) -> tuple[str, str]:
    """("B" | "I" | "O", entity type or "")."""
    return ("O", "") if tag == "O" else (tag[0], tag[2:])


def starts_with_i(sentences: list[Sentence]) -> bool:
    """Does some entity start with I- (the mark of IOB1)?"""
    for s in sentences:
        prev = "O"
        for tag in s.tags:
            kind, typ = split_tag(tag)
            if kind == "I" and (prev == "O" or split_tag(prev)[1] != typ):
                return True
            prev = tag
    return False


def to_iob2(tags: list[str]) -> list[str]:
    """IOB1 -> IOB2: an I- that starts an entity (after O or another type) becomes B-. IOB2 stays as it is."""
    out, prev = [], "O"
    for tag in tags:
        kind, typ = split_tag(tag)
        out.append(f"B-{typ}" if kind == "I" and (prev == "O" or split_tag(prev)[1] != typ) else tag)
        prev = tag
    return out


def _check_tag(uri: str, lineno: int, tag: str, types: tuple[str, ...]) -> None:
    kind, typ = split_tag(tag)
    if tag != "O" and not (kind in ("B", "I") and tag[1:2] == "-" and typ in types):
        raise StageInputError(f"{uri}:{lineno}: unknown tag {tag!r} (expected O or B-/I- with one of "
                              f"{', '.join(types)})")


def parse_conll(uri: str, text: str, types: tuple[str, ...], scheme: str = "auto") -> ConllFile:
    out, words, tags, first = ConllFile(uri), [], [], 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        cols = raw.split()
        if not cols or cols[0] == DOCSTART:
            if words:
                out.sentences.append(Sentence(words, tags, first))
            words, tags = [], []
            out.num_documents += bool(cols)
            continue
        out.num_columns = out.num_columns or len(cols)
        if len(cols) != out.num_columns or len(cols) < 2:
            raise StageInputError(f"{uri}:{lineno}: {len(cols)} columns, expected {max(out.num_columns, 2)} "
                                  f"(token ... tag) like the file's first line: {raw.strip()[:80]!r}")
        _check_tag(uri, lineno, cols[-1], types)
        first = first if words else lineno
        words.append(cols[0])
        tags.append(cols[-1])
    if words:
        out.sentences.append(Sentence(words, tags, first))
    if not out.sentences:
        raise StageInputError(f"{uri}: no sentences (expected CoNLL columns: token ... tag)")
    out.scheme = ("iob1" if starts_with_i(out.sentences) else "iob2") if scheme == "auto" else scheme
    return out


def read_conll(uri: str, types: tuple[str, ...] = ("PER", "LOC", "ORG", "MISC"), scheme: str = "auto") -> ConllFile:
    if not storage.is_file(uri):
        raise StageInputError(f"{uri}: CoNLL file does not exist")
    try:
        text = storage.read_bytes(uri).decode("utf-8")
    except UnicodeDecodeError as e:
        raise StageInputError(f"{uri}: not UTF-8 text ({e})") from None
    return parse_conll(uri, text, types, scheme)


def format_predictions(sentences: list[Sentence], predicted: list[list[str]]) -> str:
    """`word gold predicted` a line, a blank line after each sentence: what conlleval reads."""
    lines = []
    for s, pred in zip(sentences, predicted):
        lines += [f"{w} {g} {p}" for w, g, p in zip(s.words, s.tags, pred)]
        lines.append("")
    return "\n".join(lines) + "\n"
