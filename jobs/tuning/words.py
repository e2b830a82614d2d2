"""CoNLL sentences -> WordPiece rows: [CLS] pieces [SEP], the label on each word's first piece and -100
(ignored by the loss) on the rest, as BERT does for NER. A sentence longer than max_seq_length pieces is cut at
word boundaries into several rows, so every word gets a prediction."""
from __future__ import annotations

from dataclasses import dataclass, field

from bertpipe.model.bert import IGNORE_INDEX


@dataclass
class Rows:
    input_ids: list[list[int]] = field(default_factory=list)
    labels: list[list[int]] = field(default_factory=list)  # per piece: label id, IGNORE_INDEX elsewhere
    first_piece: list[list[int]] = field(default_factory=list)  # per word of the row: position of its first piece
    sentence: list[int] = field(default_factory=list)  # index of the sentence a row belongs to

    def __len__(self) -> int:
        return len(self.input_ids)


def word_pieces(tok, sentences: list[list[str]]) -> list[list[list[int]]]:
    """Per sentence, per word: its WordPiece ids (a word the vocabulary cannot split becomes [UNK])."""
    unk = tok.token_to_id("[UNK]")
    out = []
    for words, enc in zip(sentences, tok.encode_batch(sentences, is_pretokenized=True, add_special_tokens=False)):
        per_word: list[list[int]] = [[] for _ in words]
        for piece, w in zip(enc.ids, enc.word_ids):
            per_word[w].append(piece)
        out.append([p or [unk] for p in per_word])  # a word of only stripped characters still needs a position
    return out


def build_rows(tok, sentences: list[list[str]], label_ids: list[list[int]] | None, max_seq_length: int) -> Rows:
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    room = max_seq_length - 2
    out = Rows()
    for s, words in enumerate(word_pieces(tok, sentences)):
        w = 0
        while w < len(words):
            ids, labels, firsts = [cls_id], [IGNORE_INDEX], []
            while w < len(words) and (len(ids) - 1 + len(words[w]) <= room or len(ids) == 1):
                piece_ids = words[w][:room]  # a single word longer than a row keeps its first pieces
                firsts.append(len(ids))
                labels += [label_ids[s][w] if label_ids else IGNORE_INDEX] + [IGNORE_INDEX] * (len(piece_ids) - 1)
                ids += piece_ids
                w += 1
            out.input_ids.append(ids + [sep_id])
            out.labels.append(labels + [IGNORE_INDEX])
            out.first_piece.append(firsts)
            out.sentence.append(s)
    return out
