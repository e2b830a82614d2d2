"""CoNLL-2003's Reuters articles as a pre-training corpus: google-research/bert's text format (one sentence per
line, a blank line between documents), for the NSP document-count comparison in benchmarks/README.md ("Is it the
number of documents?"). Each -DOCSTART- starts a document; tokens are joined back with light detokenisation
(no space before , . ; : ! ? % ) ' and 's / n't). Documents of fewer than `--min-sentences` sentences are dropped.

    python benchmarks/conll_documents.py ../shared/data/conll2003/train.txt ../shared/data/conll2003/valid.txt \
        --out /tmp/conll_docs.txt
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path


def documents(lines) -> list[list[list[str]]]:
    """Documents → sentences → words (the first column), split at -DOCSTART- lines and blank lines."""
    docs: list[list[list[str]]] = [[]]
    sentence: list[str] = []
    for line in [*lines, ""]:  # a final blank line closes the last sentence
        word = line.split(" ", 1)[0].strip()
        if word and word != "-DOCSTART-":
            sentence.append(word)
            continue
        if sentence:
            docs[-1].append(sentence)
            sentence = []
        if word == "-DOCSTART-":
            docs.append([])
    return [d for d in docs if d]


def detokenize(words: list[str]) -> str:
    text = re.sub(r" ([.,;:!?%)'])", r"\1", " ".join(words))
    return text.replace("( ", "(").replace(" 's", "'s").replace(" n't", "n't")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--min-sentences", type=int, default=4)
    args = ap.parse_args()
    docs = [d for f in args.files for d in documents(f.read_text(encoding="utf-8").splitlines())
            if len(d) >= args.min_sentences]
    args.out.write_text("".join("\n".join(detokenize(s) for s in d) + "\n\n" for d in docs), encoding="utf-8")
    print(f"{len(docs)} documents, {sum(map(len, docs))} sentences, {sum(len(s) for d in docs for s in d)} words "
          f"→ {args.out}")


if __name__ == "__main__":
    main()
