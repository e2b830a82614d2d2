"""Builders of test dumps from the real sample: multistream bz2 + index, cut/replicated/oversized variants."""
from __future__ import annotations

import bz2
import re
from pathlib import Path

_PAGE = re.compile(r"[ \t]*<page>.*?</page>\n?", re.S)


def split_dump(xml: str) -> tuple[str, list[str], str]:
    """(header up to the first <page>, each <page>...</page>, footer) of a dump's XML text."""
    pages = [m for m in _PAGE.finditer(xml)]
    return xml[: pages[0].start()], [m.group() for m in pages], xml[pages[-1].end():]


def page_id(page_xml: str) -> int:
    return int(re.search(r"<id>(\d+)</id>", page_xml).group(1))


def write_multistream(xml: str, dest: Path, pages_per_stream: int) -> Path:
    """Write `dest` as a multistream bz2 (header stream, page streams, footer stream) and its -index.txt.bz2,
    laid out as Wikimedia does: index lines are `offset:page_id:title` with the offset of the page's stream."""
    header, pages, footer = split_dump(xml)
    index_lines = []
    with open(dest, "wb") as f:
        f.write(bz2.compress(header.encode()))
        for i in range(0, len(pages), pages_per_stream):
            group = pages[i: i + pages_per_stream]
            offset = f.tell()
            for p in group:
                title = re.search(r"<title>(.*?)</title>", p).group(1)
                index_lines.append(f"{offset}:{page_id(p)}:{title}\n")
            f.write(bz2.compress("".join(group).encode()))
        f.write(bz2.compress(footer.encode()))
    stem = dest.name[: -len(".xml.bz2")]
    index = dest.with_name(stem + "-index.txt.bz2")
    index.write_bytes(bz2.compress("".join(index_lines).encode()))
    return index
