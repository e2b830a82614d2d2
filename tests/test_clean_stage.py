"""The clean stage end to end on local Ray, its bad-input handling, and raw-input fingerprints."""
from __future__ import annotations

import bz2
import hashlib
import os
import shutil

import pyarrow.parquet as pq
import pytest

from clean_helpers import split_dump, write_multistream
from bertpipe.pipeline.stages.clean import clean_pages_batch, describe_raw_inputs, run_stage
from bertpipe.pipeline.stages.config import CleanConfig
from bertpipe.pipeline.framework.stage import StageContext, StageInputError

# 106 articles in the enwiki sample (206 pages - 100 redirects) minus 8 disambiguation pages (5 titled
# "(disambiguation)", plus Ada, Alien and Aa River tagged {{disambiguation}}/{{geodis}}) minus 1 page under
# min_article_chars=200: "List of anthropologists", whose text is all list items.
ENWIKI_ARTICLES = 97


@pytest.fixture(autouse=True)
def _private_checksum_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BERTPIPE_CACHE_DIR", str(tmp_path / "cache"))


def _run(out, *inputs, **overrides):
    cfg = CleanConfig(input=tuple(str(i) for i in inputs), **overrides)
    return run_stage(StageContext(name="clean", output_uri=str(out), config={"clean": cfg}, seed=7, inputs={}))


def _parquet_files(out):
    return sorted(n for n in os.listdir(out) if n.endswith(".parquet")) if out.exists() else []


@pytest.mark.integration
def test_enwiki_sample_end_to_end_and_deterministic(ray_local, enwiki_sample, tmp_path):
    result = _run(tmp_path / "a", enwiki_sample, rows_per_file=13)
    assert result.num_rows == ENWIKI_ARTICLES
    m = result.metrics
    assert (m["pages_seen"], m["articles"], m["redirects_skipped"], m["disambiguation_skipped"],
            m["too_short_skipped"], m["non_article_ns_skipped"], m["pages_truncated"]) == (206, 97, 99, 8, 1, 1, 0)
    assert m["mb_wikitext"] > 5 and m["mb_per_second"] > 0
    assert result.raw_inputs[0]["checksum"] == "sha256:" + hashlib.sha256(enwiki_sample.read_bytes()).hexdigest()
    files = _parquet_files(tmp_path / "a")
    assert files == [f"docs-00000-{i:04d}.parquet" for i in range(8)]  # one read unit: ceil(97 / 13) files
    tables = [pq.read_table(tmp_path / "a" / f) for f in files]
    assert [t.num_rows for t in tables] == [13] * 7 + [6]
    docs = pq.read_table(tmp_path / "a")
    assert str(docs.schema.field("id").type) == "int64" and docs.column_names == ["id", "title", "text"]
    ids = docs["id"].to_pylist()
    assert ids == sorted(ids) and len(set(ids)) == 97
    assert "Anarchism" in docs["title"].to_pylist() and "Ada" not in docs["title"].to_pylist()
    assert all(len(t) >= 200 and "[[" not in t and "{{" not in t for t in docs["text"].to_pylist())

    again = _run(tmp_path / "b", enwiki_sample, rows_per_file=13)
    assert again.num_rows == ENWIKI_ARTICLES
    for f in files:
        assert pq.read_table(tmp_path / "b" / f).equals(pq.read_table(tmp_path / "a" / f)), f


@pytest.mark.integration
def test_parallel_over_two_files_and_multistream_ranges(ray_local, enwiki_sample, sample_dumps, tmp_path):
    tables = sample_dumps["enwiki-table-markup.xml.bz2"]
    result = _run(tmp_path / "two", enwiki_sample, tables, num_read_workers=2)
    assert result.metrics["num_read_units"] == 2 and result.metrics["num_input_files"] == 2
    assert result.num_rows == ENWIKI_ARTICLES + 5

    # One multistream file read as several byte ranges gives the same documents as the plain file.
    ms = tmp_path / "in" / "enwiki-x-pages-articles-multistream.xml.bz2"
    ms.parent.mkdir()
    write_multistream(bz2.decompress(enwiki_sample.read_bytes()).decode(), ms, pages_per_stream=11)
    split = _run(tmp_path / "ms", ms, split_bytes=200_000)
    assert split.metrics["num_read_units"] > 3
    plain = _run(tmp_path / "plain", enwiki_sample)
    assert pq.read_table(tmp_path / "ms").equals(pq.read_table(tmp_path / "plain"))
    assert split.num_rows == plain.num_rows == ENWIKI_ARTICLES


@pytest.mark.integration
def test_bad_inputs_raise_naming_the_file_and_rerun_after_fix_works(ray_local, enwiki_sample, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(StageInputError, match="missing.xml.bz2 does not exist"):
        _run(out, tmp_path / "missing.xml.bz2")

    dump = tmp_path / "dump.xml.bz2"
    data = enwiki_sample.read_bytes()
    dump.write_bytes(data[: len(data) // 2])
    # Raised inside a Ray task; arrives unwrapped, as our StageInputError with our message.
    with pytest.raises(StageInputError, match=r"dump\.xml\.bz2: truncated or corrupt compressed data after page id"):
        _run(out, dump)
    assert _parquet_files(out) == []  # nothing written, let alone committed

    shutil.copyfile(enwiki_sample, dump)  # the fix: a whole dump
    assert _run(out, dump).num_rows == ENWIKI_ARTICLES

    xml = bz2.decompress(data).decode()
    bad = tmp_path / "bad.xml"
    bad.write_text(xml.replace("</revision>", "</revison>", 3))
    with pytest.raises(StageInputError, match=r"bad\.xml: malformed XML after page id \d+: mismatched tag") as info:
        _run(tmp_path / "out2", bad)
    assert "Traceback" not in str(info.value) and "RayTaskError" not in str(info.value)


@pytest.mark.integration
def test_empty_dump_utf16_dump_and_huge_page(ray_local, enwiki_sample, sample_dumps, tmp_path):
    header, pages, footer = split_dump(bz2.decompress(enwiki_sample.read_bytes()).decode())
    empty = tmp_path / "empty.xml.bz2"
    empty.write_bytes(bz2.compress((header + footer).encode()))
    with pytest.raises(StageInputError, match=r"no articles.*empty\.xml\.bz2"):
        _run(tmp_path / "e", empty)

    bg = _run(tmp_path / "bg", sample_dumps["bgwiki-latest-pages-articles-shortened.xml.bz2"])
    assert bg.num_rows == 1 and bg.metrics["non_article_ns_skipped"] == 2
    assert pq.read_table(tmp_path / "bg")["title"].to_pylist() == ["Григориански календар"]

    para = "Prose about a subject that goes on and on, repeated to make a pathological page.\n\n"
    big = (f"<page><title>Huge</title><ns>0</ns><id>7</id><revision><text>{para * 120_000}</text>"
           "</revision></page>\n")  # ~10 MB
    huge = tmp_path / "huge.xml"
    huge.write_text(header + pages[1] + big + footer)
    result = _run(tmp_path / "h", huge, max_page_bytes=300_001)
    assert result.metrics["pages_truncated"] == 1 and result.num_rows == 2
    text = dict(zip(*pq.read_table(tmp_path / "h").select(["id", "text"]).to_pydict().values()))[7]
    assert 250_000 < len(text) <= 300_001


def test_clean_pages_batch_statuses():
    import numpy as np

    batch = {"id": np.array([1, 2, 3, 4, 5]), "ns": np.array([0, 0, 0, 4, 0]),
             "redirect": np.array([False, True, False, False, False]),
             "title": np.array(["Good", "Redir", "Thing (disambiguation)", "Wikipedia:X", "Stub"], dtype=object),
             "text": np.array(["A real paragraph of prose that is long enough to keep. " * 5, "", "* [[a]]", "",
                               "Too short."], dtype=object),
             "num_bytes": np.array([275, 20, 7, 30, 10]), "truncated": np.zeros(5, bool),
             "source": np.array(["f"] * 5, dtype=object)}
    out = clean_pages_batch(batch, min_paragraph_chars=20, min_article_chars=200, skip_disambiguation=True)
    assert out["status"].tolist() == ["article", "redirect", "disambiguation", "non_article_ns", "too_short"]
    assert out["wikitext_bytes"].tolist() == [275, 0, 7, 0, 10]
    assert len(out["text"][0]) >= 200 and out["text"][4] == ""


def test_describe_raw_inputs_caches_checksums(enwiki_sample, sample_dumps, tmp_path):
    local = tmp_path / "copy.bz2"
    shutil.copyfile(enwiki_sample, local)
    cfg = CleanConfig(input=(str(tmp_path / "*.bz2"), str(sample_dumps["enwiki-table-markup.xml.bz2"])))
    first = describe_raw_inputs(cfg)
    assert [d["uri"] for d in first] == sorted([str(local), str(sample_dumps["enwiki-table-markup.xml.bz2"])])
    # Sorted by URI, so where the copy falls depends on where the checkout lives: look it up by name.
    by_uri = {d["uri"]: d for d in first}
    assert by_uri[str(local)]["size"] == local.stat().st_size
    assert by_uri[str(sample_dumps["enwiki-table-markup.xml.bz2"])]["size"] == 64107
    cache = tmp_path / "cache" / "sha256.json"
    assert cache.is_file()
    # A cached entry is trusted while (size, mtime) match: prove it by planting a fake digest.
    import json
    entries = json.loads(cache.read_text())
    entries[str(local)]["sha256"] = "planted"
    cache.write_text(json.dumps(entries))
    def checksum_of_copy():
        return {d["uri"]: d for d in describe_raw_inputs(cfg)}[str(local)]["checksum"]

    assert checksum_of_copy() == "sha256:planted"
    os.utime(local, ns=(1, 1))  # a re-downloaded dump changes mtime: the digest is recomputed
    assert checksum_of_copy() == by_uri[str(local)]["checksum"] != "sha256:planted"
    with pytest.raises(StageInputError, match=r"\*\.nothing"):
        describe_raw_inputs(CleanConfig(input=(str(tmp_path / "*.nothing"),)))
