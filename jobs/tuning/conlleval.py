"""Entity-level precision, recall and F1 exactly as CoNLL's conlleval script counts them.

conlleval reads tags token by token. A chunk ends before the current token when the previous tag was B or I
and the current one is B or O, or when the type changes; a chunk starts at B, at I after O, and at I of
another type than the previous tag's. So an I- start (IOB1) opens an entity, B- after I- of the same type
splits two adjacent entities, and a sentence boundary ends whatever is open. An entity is correct when the
guessed and the gold chunk start at the same token, end at the same token and have the same type;
precision = correct / guessed, recall = correct / gold, F1 = 2PR / (P + R) (0 when nothing is found).
conlleval also counts -DOCSTART- lines as O tokens: that changes its token accuracy, never an entity figure
(our reader drops those lines, so our `accuracy` is over real words only).
"""
from __future__ import annotations

from bertpipe.jobs.tuning.conll import split_tag


def _ends(prev: tuple[str, str], cur: tuple[str, str]) -> bool:
    (pk, pt), (ck, ct) = prev, cur
    return pk in ("B", "I") and (ck in ("B", "O") or pt != ct)


def _starts(prev: tuple[str, str], cur: tuple[str, str]) -> bool:
    (pk, pt), (ck, ct) = prev, cur
    return ck == "B" or (ck == "I" and (pk == "O" or pt != ct))


def chunks(tags: list[str]) -> set[tuple[int, int, str]]:
    """(first token, last token, type) of every chunk of one sentence, by conlleval's rules."""
    out, start, prev = set(), None, ("O", "")
    for i, tag in enumerate([*tags, "O"]):  # the trailing O closes a chunk at the sentence end
        cur = split_tag(tag)
        if start is not None and _ends(prev, cur):
            out.add((start, i - 1, prev[1]))
            start = None
        if _starts(prev, cur):
            start = i
        prev = cur
    return out


def score(gold: list[list[str]], guessed: list[list[str]]) -> dict[str, float]:
    """precision, recall, f1 (in [0, 1]) over all sentences, counts, token accuracy, and per-type f1."""
    if len(gold) != len(guessed) or any(len(g) != len(p) for g, p in zip(gold, guessed)):
        raise ValueError("gold and guessed tags differ in shape")
    counts: dict[str, list[int]] = {}  # type -> [correct, guessed, gold]
    tokens = right = 0
    for g, p in zip(gold, guessed):
        gc, pc = chunks(g), chunks(p)
        for c in gc | pc:
            row = counts.setdefault(c[2], [0, 0, 0])
            row[0] += c in gc and c in pc
            row[1] += c in pc
            row[2] += c in gc
        tokens += len(g)
        right += sum(a == b for a, b in zip(g, p))
    correct, found, real = (sum(r[k] for r in counts.values()) for k in range(3))
    out = _prf(correct, found, real)
    out.update({"correct": float(correct), "guessed": float(found), "gold": float(real),
                "accuracy": right / tokens if tokens else 0.0})
    for typ, (c, f, r) in sorted(counts.items()):
        out[f"{typ}.f1"] = _prf(c, f, r)["f1"]
    return out


def _prf(correct: int, found: int, real: int) -> dict[str, float]:
    p = correct / found if found else 0.0
    r = correct / real if real else 0.0
    return {"precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0}
