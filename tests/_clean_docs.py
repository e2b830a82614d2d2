"""Clean-document Parquet for the vocab/pairs tests: the real clean stage's output when it exists, otherwise a
crude regex extraction of the real enwiki sample (good enough to give real English sentences)."""
from __future__ import annotations

import bz2
import html
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

_PAGE = re.compile(r"<page>.*?<ns>(\d+)</ns>\s*<id>(\d+)</id>.*?(<redirect|<text[^>]*>(.*?)</text>)", re.S)
_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_REF = re.compile(r"<ref[^>]*/>|<ref[^>]*>.*?</ref>", re.S)
_TAG = re.compile(r"<[^>]+>")
_LINK = re.compile(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]")
_EXTLINK = re.compile(r"\[https?://[^\s\]]+\s*([^\]]*)\]")


def crude_docs(dump: Path, min_chars: int = 400) -> list[dict]:
    """(id, title, text) of the dump's articles with markup crudely removed; paragraphs joined by "\\n"."""
    raw = bz2.open(dump, "rt", encoding="utf-8").read()
    titles = re.findall(r"<title>(.*?)</title>", raw)
    docs = []
    for title, m in zip(titles, _PAGE.finditer(raw)):
        if m.group(1) != "0" or m.group(3).startswith("<redirect"):
            continue
        text = html.unescape(m.group(4) or "")
        text = _REF.sub("", text)
        for _ in range(5):
            text = _TEMPLATE.sub("", text)
        text = re.sub(r"\[\[(?:File|Image|Category):[^\n]*", "", text)
        text = _LINK.sub(r"\1", _EXTLINK.sub(r"\1", text))
        text = _TAG.sub("", text).replace("'''", "").replace("''", "")
        paragraphs = [
            p.strip() for p in text.split("\n")
            if len(p.strip()) > 40 and not p.lstrip().startswith(("=", "*", "#", "|", "{", "}", "!", ":", ";"))
        ]
        body = "\n".join(paragraphs)
        if len(body) >= min_chars:
            docs.append({"id": int(m.group(2)), "title": title, "text": body})
    return docs


def write_clean_folder(docs: list[dict], folder: Path, rows_per_file: int = 37) -> Path:
    """Clean-stage-shaped folder (docs-*.parquet + a committed manifest) from `docs`."""
    from bertpipe.pipeline.framework.stage import StageResult, write_manifest
    import time

    folder.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("id", pa.int64()), ("title", pa.string()), ("text", pa.string())])
    for i in range(0, len(docs), rows_per_file):
        table = pa.Table.from_pylist(docs[i:i + rows_per_file], schema=schema)
        pq.write_table(table, folder / f"docs-{i // rows_per_file:05d}.parquet")
    write_manifest(str(folder), stage="clean", fingerprint="test", result=StageResult(num_rows=len(docs)),
                   config={}, inputs={}, started=time.time(), code_version="test")
    return folder


def clean_folder(enwiki_sample: Path, tmp: Path, ray_ok: bool = False) -> tuple[Path, str]:
    """A clean folder for the enwiki sample: the real clean stage when importable (and Ray is up), else crude."""
    if ray_ok:
        try:
            from bertpipe.pipeline.stages import clean  # noqa: F401
            from bertpipe.pipeline.stages.config import CleanConfig
            from bertpipe.pipeline.framework.stage import StageContext, write_manifest
            import time

            out = tmp / "clean"
            out.mkdir(parents=True, exist_ok=True)
            ctx = StageContext(name="clean", output_uri=str(out),
                               config={"clean": CleanConfig(input=(str(enwiki_sample),))}, seed=12345, inputs={})
            started = time.time()
            result = clean.run_stage(ctx)
            write_manifest(str(out), stage="clean", fingerprint="test", result=result, config={}, inputs={},
                           started=started, code_version="test")
            return out, "clean-stage"
        except ImportError:
            pass
    return write_clean_folder(crude_docs(enwiki_sample), tmp / "crude-clean"), "crude"
