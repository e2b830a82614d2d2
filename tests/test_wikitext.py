"""wikitext -> paragraphs: real pages from the sample dumps, plus small cases for each kind of markup."""
from __future__ import annotations

import re

import pytest

from bertpipe.pipeline.stages.dump_reader import iter_pages
from bertpipe.pipeline.stages.wikitext import drop_braces, is_disambiguation, replace_links, strip_with_mwparser, \
    wikitext_to_paragraphs

# Markup that must never survive into clean text.
MARKUP = ["{{", "}}", "{|", "|}", "[[", "]]", "==", "<ref", "</ref", "Category:", "File:", "Image:", "thumb|",
          "<!--", "<math", "__NOTOC__", "'''"]


@pytest.fixture(scope="module")
def articles(enwiki_sample):
    return [p for p in iter_pages(str(enwiki_sample)) if p.ns == 0 and not p.redirect]


@pytest.fixture(scope="module")
def table_pages(sample_dumps):
    return list(iter_pages(str(sample_dumps["enwiki-table-markup.xml.bz2"])))


def test_no_markup_survives_in_any_sample_article(articles, table_pages):
    assert len(articles) == 106
    checked = 0
    for page in articles + table_pages:
        for para in wikitext_to_paragraphs(page.text):
            checked += 1
            for mark in MARKUP:
                assert mark not in para, (page.id, page.title, mark, para[:200])
            assert not para.startswith(("*", "#", ":", ";", "|", "!")), (page.id, para[:80])
            assert "\n" not in para
    assert checked > 2_000  # the sample really was cleaned, not emptied


def test_sample_article_keeps_prose_and_link_text(articles):
    anarchism = next(p for p in articles if p.title == "Anarchism")
    paras = wikitext_to_paragraphs(anarchism.text)
    assert paras[0].startswith("Anarchism is a political philosophy that advocates self-governed societies")
    # [[stateless society|stateless societies]] keeps its label; headings such as "==Etymology and terminology=="
    # are gone, and the reference list at the end (lists of <ref>s) leaves nothing behind.
    assert "stateless societies" in paras[0]
    assert not any(p.strip() == "Etymology and terminology" for p in paras)
    assert all(len(p) >= 20 for p in paras)


def test_tables_in_table_markup_dump_leave_no_cell_text(table_pages):
    text = {p.title: "\n".join(wikitext_to_paragraphs(p.text)) for p in table_pages}
    # Cell contents taken from the tables of these real pages (and found nowhere in their prose).
    assert "Opposition candidate (party)" not in text["Constructive vote of no confidence"]
    assert "Awards resulted from 39 nominations" not in text["Academy Award for Best Production Design"]
    assert "Tallink Grupp" not in text["Economy of Estonia"] and "937.8" not in text["Economy of Estonia"]
    assert "Lincoln Burrows" not in text["List of Prison Break characters"].split("\n")[0]
    # ... while the prose around the tables is kept.
    assert "The principle is intended to ensure that a replacement head of government" in \
        text["Constructive vote of no confidence"]
    assert all(len(t) > 200 for t in text.values())


def test_our_words_are_a_subset_of_the_reference_parser(articles):
    """Cross-check with mwparserfromhell's strip_code (which keeps more: lists, table cells): nearly every word we
    emit must appear in its output too, so the fast scanner never invents text from markup."""
    word = re.compile(r"[A-Za-z]{4,}")
    for page in articles[:25]:
        ours = word.findall(" ".join(wikitext_to_paragraphs(page.text)))
        if len(ours) < 50:
            continue
        reference = set(word.findall(strip_with_mwparser(page.text)))
        missing = [w for w in ours if w not in reference]
        assert len(missing) / len(ours) < 0.01, (page.title, missing[:20])


def test_templates_nested_and_tables_nested_in_templates():
    text = "Before {{Infobox|a={{nested|{{deeper}}}}|b=\n{|\n| cell {{x}}\n|}\n}} after the box stays here."
    assert drop_braces(text) == "Before  after the box stays here."
    assert wikitext_to_paragraphs(text) == ["Before after the box stays here."]


def test_unclosed_template_is_dropped_to_end_of_paragraph_only():
    text = "Broken {{cite web|url=x and the rest of this line\n\nThe next paragraph is long enough to be kept."
    assert wikitext_to_paragraphs(text) == ["The next paragraph is long enough to be kept."]


def test_links_files_categories_and_interlanguage():
    text = ("[[File:Foo.jpg|thumb|250px|A caption with a [[link|nested link]] inside]]"
            "The [[river]]s of [[Estonia|the country]] and [[:Category:Rivers|a category page]]; see "
            "[http://example.org the site] or [http://example.org].[[Category:Rivers of Estonia]][[de:Fluss]]")
    assert replace_links(text) == ("The rivers of the country and a category page; see the site or .")


def test_refs_comments_math_lists_headings_are_dropped():
    text = """Intro sentence that is long enough.<ref name="a">{{cite book|title=X}}</ref><ref name="b" />
Same paragraph continues here<!-- hidden note --> with <math>x^2</math> a formula.

== Heading ==
* list item that is long enough to count
# numbered item that is long enough to count
; term : definition that is long enough
Final &ndash; paragraph with an&nbsp;entity and <small>small text</small>."""
    assert wikitext_to_paragraphs(text) == [
        "Intro sentence that is long enough. Same paragraph continues here with a formula.",
        "Final – paragraph with an entity and small text.",
    ]


def test_min_paragraph_chars_is_an_inclusive_bound():
    kept = "A paragraph of 37 characters, odd on!"
    assert len(kept) == 37
    text = "Tiny.\n\n" + kept
    assert wikitext_to_paragraphs(text, min_paragraph_chars=37) == [kept]
    assert wikitext_to_paragraphs(text, min_paragraph_chars=38) == []


def test_disambiguation_detection(articles):
    dab = sorted(p.title for p in articles if is_disambiguation(p.title, p.text))
    assert dab == ["Aa River", "Aberdeen (disambiguation)", "Ada", "Alien", "Animal (disambiguation)",
                   "Argument (disambiguation)", "Asia Minor (disambiguation)", "Austin (disambiguation)"]
    assert not is_disambiguation("Redis", "{{Redis|x}} is not a disambiguation template")


def test_deterministic(articles):
    page = articles[3]
    assert wikitext_to_paragraphs(page.text) == wikitext_to_paragraphs(page.text)
