"""Wikitext -> plain paragraphs, the way the BERT paper built its corpus: "text passages only, ignoring lists,
tables, and headers". Pure functions, no I/O, deterministic (templates are dropped, never expanded, so nothing
depends on today's date as WikiExtractor's {{CURRENTYEAR}} expansion does).

Design for speed: a full mwparserfromhell parse builds a Python object per node and runs ~3x slower than
WikiExtractor. Most bytes of an article are markup we drop anyway (infoboxes, citation templates, refs, tables),
so one nesting-aware scan cuts templates and tables, a handful of compiled regexes cut tags/comments/links, and
line rules drop lists and headings. `strip_with_mwparser` is the slow reference, used by tests to cross-check.
"""
from __future__ import annotations

import html
import re

# Tags whose whole content is dropped: references, math and chemistry, media, code blocks, hidden markup.
_DROP_TAGS = ("ref", "references", "math", "chem", "ce", "score", "gallery", "timeline", "imagemap", "graph",
              "syntaxhighlight", "source", "pre", "hiero", "mapframe", "maplink", "templatedata", "inputbox",
              "table", "noinclude", "includeonly", "categorytree", "poem", "sup class=\"reference\"")
_TAG_NAMES = "|".join(re.escape(t) for t in _DROP_TAGS if " " not in t)
_COMMENT = re.compile(r"<!--.*?(?:-->|\Z)", re.S)
# <ref name=x /> first (self-closing), then paired blocks; a block with no closing tag ends at the paragraph's end
# so one unclosed <ref> cannot swallow the rest of the article.
_SELF_CLOSING = re.compile(rf"<(?:{_TAG_NAMES})\b[^>]*/>", re.I)
_DROP_BLOCK = re.compile(rf"<({_TAG_NAMES})\b[^>]*>.*?(?:</\1\s*>|(?=\n\n)|\Z)", re.I | re.S)
_ANY_TAG = re.compile(r"</?[A-Za-z][^<>\n]*>")
# Braces: templates {{ }}, tables {| |} (only at line start, as MediaWiki requires).
_BRACE_TOKEN = re.compile(r"\{\{|\}\}|(?m:^[ \t:]*\{\|)|(?m:^[ \t]*\|\})")
# Innermost [[...]] first, so links inside a file caption resolve before the file link is dropped.
_WIKILINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_EXTLINK = re.compile(r"\[(?:https?:|ftp:)?//[^\s\[\]]*(?:\s+([^\[\]]*))?\]", re.I)
_BARE_URL = re.compile(r"\bhttps?://[^\s]+")
_BOLD_ITALIC = re.compile(r"'{2,5}")
_MAGIC = re.compile(r"__[A-Z]+__")
_SPACES = re.compile(r"[ \t\u00a0]{2,}")
_SPACE_BEFORE_PUNCT = re.compile(r"[ \t]+([,.;:!?)\]])")
_EMPTY_PARENS = re.compile(r"\([ \t]*(?:[,;:][ \t]*)*\)")
_PAREN_LEAD = re.compile(r"\([ \t]*[,;:][ \t]*")
# Links into these namespaces are dropped entirely (media, categories); others keep their text.
_DROP_LINK_NS = {"file", "image", "media", "category", "datei", "bild", "fichier", "archivo", "категория", "файл",
                 "изображение"}
# Interlanguage links ([[de:Foo]]) are dropped: lowercase 2-3 letter (or xx-yy) prefix.
_INTERLANG = re.compile(r"^[a-z]{2,3}(?:-[a-z]{2,8})?:")
# Lines that are not prose: lists (* # ; :), headings (=), table rows left by broken tables (| !), rules (----).
_NON_PROSE_START = ("*", "#", ";", ":", "=", "|", "!", "{|", "----")
_DISAMBIG = re.compile(
    r"\{\{\s*(?:disambig\w*|disamb|dab|(?:hn|geo|number|math|road|school|species|letter-number )dis"
    r"|set index(?: article)?|[^{}|]*disambiguation[^{}|]*)\s*[|}]",
    re.I)


def is_disambiguation(title: str, wikitext: str) -> bool:
    """Disambiguation pages are lists of links, not prose: the title says so or a {{disambiguation}}-like template."""
    return title.endswith("(disambiguation)") or _DISAMBIG.search(wikitext) is not None


def drop_braces(text: str) -> str:
    """Remove templates {{...}} and tables {|...|}, nesting-aware (tables hold templates and vice versa).

    A block that never closes (a typo, or a page cut at max_page_bytes) is dropped up to the end of its paragraph,
    not to the end of the page, so one stray `{{` cannot eat an article.
    """
    out: list[str] = []
    pos = 0
    while True:
        depth = 0
        start = pos
        for m in _BRACE_TOKEN.finditer(text, pos):
            tok = m.group().lstrip(" \t:")
            if tok in ("{{", "{|"):
                if depth == 0:
                    out.append(text[pos:m.start()])
                    start = m.start()
                depth += 1
            elif depth > 0:  # a closer with nothing open is left as text (and removed by later rules)
                depth -= 1
                if depth == 0:
                    pos = m.end()
        if depth == 0:
            out.append(text[pos:])
            return "".join(out)
        # Unclosed block opened at `start`: skip to the next blank line and scan the rest again.
        end = text.find("\n\n", start)
        if end < 0:
            return "".join(out)
        pos = end


def _link_text(m: re.Match) -> str:
    inner = m.group(1)
    target, bar, label = inner.partition("|")
    target = target.strip()
    colon = target.find(":")
    if colon > 0:
        ns = target[:colon].strip().lower()
        if ns in _DROP_LINK_NS or _INTERLANG.match(target):
            return ""
    if target.startswith(":"):  # [[:Category:X|text]] is a plain link to the category page
        target = target[1:]
    if bar:
        # The last part is the label (file-like syntax never reaches here); an empty label is the "pipe trick".
        label = label.rsplit("|", 1)[-1].strip()
        return label or re.sub(r"\s*\(.*\)$", "", target.split(":", 1)[-1])
    return target.split("#", 1)[0] if not target.startswith("#") else target[1:]


def replace_links(text: str) -> str:
    """[[target|label]] -> label, [[target]] -> target, file/category/interlanguage links -> ''."""
    for _ in range(8):  # nesting depth of links inside file captions is small; bounded for pathological input
        new = _WIKILINK.sub(_link_text, text)
        if new == text:
            break
        text = new
    return _EXTLINK.sub(lambda m: m.group(1) or "", text)


def _finish(text: str) -> str:
    """Tag, entity and spacing clean-up, run once over all paragraphs joined by newlines (patterns never cross
    a newline), since per-paragraph calls cost more in call overhead than in matching."""
    text = _ANY_TAG.sub("", text)
    text = html.unescape(text).replace("\u00a0", " ")
    text = _BARE_URL.sub("", text)
    text = _EMPTY_PARENS.sub("", text)
    text = _PAREN_LEAD.sub("(", text)
    text = _SPACES.sub(" ", text)
    return _SPACE_BEFORE_PUNCT.sub(r"\1", text)


def wikitext_to_paragraphs(wikitext: str, *, min_paragraph_chars: int = 20) -> list[str]:
    """Plain-text paragraphs of an article, in reading order; markup that is not running prose is dropped."""
    text = _COMMENT.sub("", wikitext)
    text = _SELF_CLOSING.sub("", text)
    text = _DROP_BLOCK.sub("", text)
    text = drop_braces(text)
    text = replace_links(text)
    text = _BOLD_ITALIC.sub("", text)
    text = _MAGIC.sub("", text)
    paragraphs: list[str] = []
    current: list[str] = []
    for line in text.split("\n"):
        line = line.strip()
        # A blank line or a non-prose line ends the paragraph; a single newline inside prose is a soft break.
        if not line or line.startswith(_NON_PROSE_START):
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        current.append(line)
    if current:
        paragraphs.append(" ".join(current))
    paragraphs = _finish("\n".join(paragraphs)).split("\n")
    return [p for p in (p.strip() for p in paragraphs) if len(p) >= min_paragraph_chars and not _leftover_markup(p)]


def _leftover_markup(para: str) -> bool:
    # Stray halves of broken markup ("}}" with no opener, "[[" never closed) mean the paragraph is garbage.
    return "{{" in para or "}}" in para or "[[" in para or "]]" in para or "{|" in para


def strip_with_mwparser(wikitext: str) -> str:
    """Reference cleaner: mwparserfromhell parse + strip_code (slow; for tests and the benchmark only)."""
    import mwparserfromhell

    return mwparserfromhell.parse(wikitext).strip_code(normalize=True, collapse=True)
