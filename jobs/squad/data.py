"""Reading a SQuAD-format JSON file (v1.1 or v2.0) into flat examples, with the answer offsets checked.

Any file in the official layout works ({"data": [{"title", "paragraphs": [{"context", "qas": [{"id",
"question", "answers": [{"text", "answer_start"}], "is_impossible"?}]}]}]}); `articles` = (start, end) picks
articles start..end-1 ([0, 38]; empty = all), which is how a single file is split into train and evaluation sets
by article (questions of one paragraph share their context, so a split by question would leak).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.stage import StageInputError


@dataclass(frozen=True)
class Answer:
    text: str
    start: int  # character offset in the context

    @property
    def end(self) -> int:
        return self.start + len(self.text)


@dataclass(frozen=True)
class Example:
    qid: str
    question: str
    context: str
    answers: tuple[Answer, ...]  # every reference answer (several in dev sets); empty when unanswerable
    is_impossible: bool = False
    title: str = ""


@dataclass
class SquadSet:
    uri: str
    examples: list[Example] = field(default_factory=list)
    num_articles: int = 0
    version_2: bool = False  # the file holds unanswerable questions (or says version 2.0)


def article_range(articles: tuple[int, ...], where: str) -> slice:
    """(start, end) -> slice(start, end); () -> everything; ValueError naming `where` otherwise."""
    if not articles:
        return slice(None)
    if len(articles) != 2 or not 0 <= articles[0] < articles[1]:
        raise ValueError(f"{where}: {list(articles)} is not an article range [start, end) like [0, 38]")
    return slice(*articles)


def _answers(uri: str, qa: dict, context: str) -> tuple[Answer, ...]:
    out = []
    for a in qa.get("answers", []):
        text, start = a.get("text"), a.get("answer_start")
        if not isinstance(text, str) or not isinstance(start, int):
            raise StageInputError(f"{uri}: question {qa['id']}: answer {a!r} lacks text or answer_start")
        if context[start:start + len(text)] != text:
            raise StageInputError(f"{uri}: question {qa['id']}: answer {text!r} at offset {start} does not match "
                                  f"the context there ({context[start:start + len(text)]!r})")
        out.append(Answer(text, start))
    return tuple(out)


def _question(uri: str, qa: dict, context: str, title: str) -> Example:
    if not isinstance(qa, dict) or "id" not in qa or not isinstance(qa.get("question"), str):
        raise StageInputError(f"{uri}: a question entry lacks its id or question text ({str(qa)[:120]})")
    answers = _answers(uri, qa, context)
    impossible = bool(qa.get("is_impossible", False))
    if not answers and not impossible:
        raise StageInputError(f"{uri}: question {qa['id']} has no answer and is not marked is_impossible")
    # v2.0 lists "plausible_answers" for unanswerable questions, never "answers": they are not references.
    return Example(str(qa["id"]), qa["question"], context, () if impossible else answers, impossible, title)


def read_squad(uri: str, articles: tuple[int, ...] = ()) -> SquadSet:
    """The examples of the selected articles of a SQuAD file; StageInputError naming the file (and the question
    id) for a missing file, a file that is not SQuAD JSON, or an answer whose offset does not match its context."""
    if not storage.is_file(uri):
        raise StageInputError(f"{uri}: SQuAD file does not exist")
    try:
        doc = json.loads(storage.read_bytes(uri))
    except (ValueError, UnicodeDecodeError) as e:
        raise StageInputError(f"{uri}: not a JSON file ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise StageInputError(f"{uri}: not in SQuAD format (no top-level \"data\" list)")
    chosen = doc["data"][article_range(articles, uri)]
    out = SquadSet(uri, num_articles=len(chosen), version_2=str(doc.get("version", "")).startswith("2"))
    for article in chosen:
        for para in article.get("paragraphs", []):
            context = para.get("context")
            if not isinstance(context, str):
                raise StageInputError(f"{uri}: a paragraph of {article.get('title')!r} has no context string")
            for qa in para.get("qas", []):
                out.examples.append(_question(uri, qa, context, article.get("title", "")))
    out.version_2 = out.version_2 or any(e.is_impossible for e in out.examples)
    seen = set()
    for e in out.examples:
        if e.qid in seen:
            raise StageInputError(f"{uri}: question id {e.qid} appears twice")
        seen.add(e.qid)
    return out
