"""Streaming dump reader on the real samples and on broken variants of them."""
from __future__ import annotations

import bz2
import tracemalloc

import pytest

from clean_helpers import page_id, split_dump, write_multistream
from bertpipe.pipeline.stages.dump_reader import ReadUnit, expand_inputs, find_index, iter_pages, plan_units
from bertpipe.pipeline.framework.stage import StageInputError


@pytest.fixture(scope="module")
def enwiki_xml(enwiki_sample) -> str:
    return bz2.decompress(enwiki_sample.read_bytes()).decode("utf-8")


def test_reads_all_pages_of_the_enwiki_sample(enwiki_sample):
    pages = list(iter_pages(str(enwiki_sample)))
    assert len(pages) == 206
    assert sum(p.redirect for p in pages) == 100
    assert [(p.id, p.title) for p in pages[:2]] == [(10, "AccessibleComputing"), (12, "Anarchism")]
    assert sum(p.ns == 0 and not p.redirect for p in pages) == 106
    anarchism = pages[1]
    # The XML reader unescapes &lt;ref&gt; once: wikitext arrives as the editor typed it.
    assert "<ref" in anarchism.text and "&lt;ref" not in anarchism.text
    assert anarchism.num_bytes == len(anarchism.text.encode()) and not anarchism.truncated


def test_utf16_bgwiki_is_decoded(sample_dumps):
    """Decision: decode, not refuse. expat honours the UTF-16LE byte-order mark; XML turns CRLF into LF."""
    pages = list(iter_pages(str(sample_dumps["bgwiki-latest-pages-articles-shortened.xml.bz2"])))
    assert [(p.id, p.ns) for p in pages] == [(558, 0), (559, 4), (560, 4)]
    assert pages[0].title == "Григориански календар"
    assert "\r" not in pages[0].text and "Григорианският календар" in pages[0].text


def test_unsupported_encoding_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "koi.xml"
    path.write_bytes(b'<?xml version="1.0" encoding="x-no-such-codec"?><mediawiki></mediawiki>')
    with pytest.raises(StageInputError, match=r"koi\.xml.*(encoding|malformed)"):
        list(iter_pages(str(path)))


def test_missing_file(tmp_path):
    with pytest.raises(StageInputError, match="nope.xml.bz2"):
        list(iter_pages(str(tmp_path / "nope.xml.bz2")))


def test_truncated_bz2_names_file_and_last_page(enwiki_sample, tmp_path):
    data = enwiki_sample.read_bytes()
    cut = tmp_path / "cut.xml.bz2"
    cut.write_bytes(data[: len(data) // 2])
    seen = []
    with pytest.raises(StageInputError, match=r"cut\.xml\.bz2: truncated or corrupt compressed data after page id \d+"):
        for page in iter_pages(str(cut)):
            seen.append(page.id)
    assert 20 < len(seen) < 206  # pages before the cut were streamed out before the error


def test_malformed_xml_names_file_and_page(enwiki_xml, tmp_path):
    broken = enwiki_xml.replace("<title>Anarchism</title>", "<title>Anarchism</titel>", 1)
    path = tmp_path / "broken.xml"
    path.write_text(broken)
    with pytest.raises(StageInputError, match=r"broken\.xml: malformed XML after page id 10: mismatched tag"):
        list(iter_pages(str(path)))


def test_empty_dump_yields_no_pages(enwiki_xml, tmp_path):
    header, _, footer = split_dump(enwiki_xml)
    path = tmp_path / "empty.xml"
    path.write_text(header + footer)
    assert list(iter_pages(str(path))) == []


def test_huge_page_is_cut_and_memory_stays_bounded(enwiki_xml, tmp_path):
    header, pages, footer = split_dump(enwiki_xml)
    para = "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.\n\n"
    big_text = para * (24_000_000 // len(para))  # ~24 MB of wikitext in one page
    big = f"<page><title>Huge</title><ns>0</ns><id>999999</id><revision><text>{big_text}</text></revision></page>\n"
    path = tmp_path / "huge.xml"
    path.write_text(header + pages[1] + big + pages[2] + footer)
    tracemalloc.start()
    got = list(iter_pages(str(path), max_page_bytes=1_000_003))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert [p.id for p in got] == [page_id(pages[1]), 999999, page_id(pages[2])]
    huge = got[1]
    assert huge.truncated and len(huge.text.encode()) <= 1_000_003 and huge.num_bytes > 1_000_003
    assert not got[0].truncated and not got[2].truncated
    assert peak < 12_000_000, f"peak {peak / 1e6:.1f} MB while reading a 24 MB page"


def test_multistream_ranges_give_the_same_pages_as_the_whole_file(enwiki_xml, tmp_path):
    dump = tmp_path / "enwiki-test-pages-articles-multistream.xml.bz2"
    index = write_multistream(enwiki_xml, dump, pages_per_stream=7)
    assert find_index(str(dump)) == str(index)
    units = plan_units(str(dump), dump.stat().st_size, target_bytes=150_000)
    assert len(units) > 3 and all(u.is_range for u in units)
    assert units[-1].end == dump.stat().st_size
    whole = [(p.id, p.title, p.text) for p in iter_pages(str(dump))]
    pieces = [(p.id, p.title, p.text) for u in units for p in iter_pages(u)]
    assert len(whole) == 206 and pieces == whole


def test_plain_file_is_one_unit(enwiki_sample):
    assert plan_units(str(enwiki_sample), 10**12, target_bytes=1) == [ReadUnit(str(enwiki_sample))]


def test_expand_inputs_globs(tmp_path, enwiki_xml):
    write_multistream(enwiki_xml, tmp_path / "a-multistream.xml.bz2", pages_per_stream=50)
    (tmp_path / "b.xml").write_text("<mediawiki/>")
    assert expand_inputs((str(tmp_path / "*"),)) == [str(tmp_path / "a-multistream.xml.bz2"), str(tmp_path / "b.xml")]
    with pytest.raises(StageInputError, match=r"matches no file"):
        expand_inputs((str(tmp_path / "*.nothing"),))
