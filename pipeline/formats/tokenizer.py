"""The project's one BERT tokenizer: what pairs (pre-training data), fine-tuning, feature extraction and the export
mean by "tokenize this text with this vocabulary and casing".

It is Hugging Face's `BertTokenizerFast` (transformers' `BertTokenizer`) built on the same vocab.txt and casing,
piece for piece (tests/test_tokenizer.py checks it on thousands of real sentences): the BERT normalizer (control
characters removed, CJK characters spaced, accents stripped and text lowercased when uncased), the BERT
pre-tokenizer, WordPiece with words longer than 100 characters as [UNK], and the five special tokens registered.
It deliberately follows Hugging Face where Google's FullTokenizer differs, because users load our exports with
`AutoTokenizer` and fine-tuning must see the pieces pre-training saw:
- a literal "[SEP]" (exact case, anywhere in the text, "[sep]" is not one) is the [SEP] token, not "[", "sep", "]";
  the same for [CLS], [MASK], [PAD] and [UNK];
- a word of 101 to 200 characters is [UNK] (FullTokenizer's limit is 200).

`tokenizer_files` is what an export writes beside vocab.txt so that `AutoTokenizer.from_pretrained` rebuilds this
tokenizer with the right casing; `folder_lowercase` reads that casing back (fine-tuning, features).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Hugging Face's WordPiece limit (BertTokenizerFast and BertTokenizer); longer words are [UNK].
MAX_CHARS_PER_WORD = 100
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
_ROLES = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
          "mask_token": "[MASK]"}


def bert_normalizer(lowercase: bool) -> normalizers.Normalizer:
    # strip_accents=None follows `lowercase`, as in BertTokenizerFast and Google's BasicTokenizer.
    return normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                      lowercase=lowercase)


def bert_tokenizer(vocab: list[str] | dict[str, int], lowercase: bool) -> Tokenizer:
    """The BERT tokenizer over a vocabulary (a token list, id = index, or {token: id}).

    `encode(a)` gives [CLS] a [SEP], `encode(a, b)` [CLS] a [SEP] b [SEP] with type ids 0/1; pass
    add_special_tokens=False for the pieces alone (the pairs stage adds [CLS]/[SEP] itself).
    """
    index = vocab if isinstance(vocab, dict) else {t: i for i, t in enumerate(vocab)}
    tok = Tokenizer(models.WordPiece(vocab=index, unk_token="[UNK]", max_input_chars_per_word=MAX_CHARS_PER_WORD))
    tok.normalizer = bert_normalizer(lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    # As BertTokenizerFast: matched in the raw text before normalization (normalized=False), exact case only.
    tok.add_special_tokens([t for t in SPECIAL_TOKENS if t in index])
    cls, sep = ("[CLS]", index["[CLS]"]), ("[SEP]", index["[SEP]"])
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[cls, sep])
    return tok


def read_vocab_file(path: str | Path) -> dict[str, int]:
    """{token: line number} of a local vocab.txt, read as transformers reads it (a repeated token keeps its last
    line). The pipeline's own vocabularies are checked further by pipeline/formats/vocabulary.py `load_vocab`."""
    with open(path, encoding="utf-8") as f:
        return {token.rstrip("\n"): i for i, token in enumerate(f.readlines())}


def folder_lowercase(model_dir: str | Path) -> bool:
    """A model folder's casing: tokenizer_config.json's do_lower_case (what our exports and Hugging Face's models
    write); a folder without one: config.json's do_lower_case, else True (BERT's default, uncased)."""
    model_dir = Path(model_dir)
    return lowercase_of(*(json.loads((model_dir / name).read_text(encoding="utf-8"))
                          if (model_dir / name).is_file() else None for name in (TOKENIZER_CONFIG, "config.json")))


def lowercase_of(tokenizer_config: dict | None, config: dict | None) -> bool:
    """The casing rule of `folder_lowercase` on the two files' contents (None: the folder has no such file)."""
    for contents in (tokenizer_config, config):
        value = (contents or {}).get("do_lower_case")
        if value is not None:
            return bool(value)
    return True


def load_tokenizer(model_dir: str | Path, truncate_at: int | None = None) -> Tokenizer:
    """The tokenizer of a Hugging Face-layout model folder (its vocab.txt and casing, `folder_lowercase`), without
    padding; truncated longest-first at `truncate_at` pieces, or not at all (tasks that cut windows themselves
    need every offset)."""
    model_dir = Path(model_dir)
    tok = bert_tokenizer(read_vocab_file(model_dir / "vocab.txt"), folder_lowercase(model_dir))
    if truncate_at:
        tok.enable_truncation(max_length=truncate_at, strategy="longest_first")
    tok.no_padding()
    return tok


def tokenizer_files(lowercase: bool, model_max_length: int) -> dict[str, str]:
    """{file name: text} that make a folder with vocab.txt load as this tokenizer in transformers' AutoTokenizer."""
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": lowercase, "strip_accents": None,
              "tokenize_chinese_chars": True, "model_max_length": model_max_length, **_ROLES}
    return {TOKENIZER_CONFIG: json.dumps(config, indent=2, sort_keys=True) + "\n",
            SPECIAL_TOKENS_MAP: json.dumps(_ROLES, indent=2, sort_keys=True) + "\n"}
