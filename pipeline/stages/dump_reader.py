"""Streaming reader of MediaWiki XML dumps (`pages-articles*.xml[.bz2]`) from any smart_open URI.

Never holds a dump in memory: bytes are decompressed and fed to expat 1 MiB at a time, and a page's text stops
being accumulated past `max_page_bytes`. Multistream dumps (`*-multistream.xml.bz2` with `*-multistream-index
.txt[.bz2]` beside it) are split into byte ranges of whole bz2 streams so several workers read one file.

Encodings: expat reads what the XML declaration or byte-order mark says (UTF-8, UTF-16 with BOM, ISO-8859-1,
US-ASCII), so the UTF-16 bgwiki sample is decoded properly, CRLF included (XML normalises line ends); any other
declared encoding is refused with a StageInputError naming the file.
"""
from __future__ import annotations

import bz2
import fnmatch
import glob
import gzip
import io
import os
import posixpath
import xml.parsers.expat
from dataclasses import dataclass
from typing import Iterator

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.stage import StageInputError

CHUNK_BYTES = 1 << 20
_INDEX_SUFFIXES = ("-index.txt.bz2", "-index.txt")


@dataclass(frozen=True, slots=True)
class Page:
    id: int
    ns: int
    title: str
    redirect: bool
    text: str
    # UTF-8 size of the page's wikitext as stored in the dump (before any cut).
    num_bytes: int
    truncated: bool


@dataclass(frozen=True)
class ReadUnit:
    """One task's share of the input: a whole file, or a byte range [start, end) of whole bz2 streams."""

    uri: str
    start: int = -1
    end: int = -1

    @property
    def is_range(self) -> bool:
        return self.start >= 0


def expand_inputs(patterns: tuple[str, ...] | list[str]) -> list[str]:
    """Globs/URIs -> sorted concrete URIs. Multistream index files are not dumps and are left out of globs."""
    if not patterns:
        raise StageInputError("clean.input is empty: name at least one dump")
    out: list[str] = []
    for pattern in patterns:
        if not any(c in pattern for c in "*?["):
            out.append(pattern)
            continue
        if storage.is_remote(pattern) and not pattern.startswith("file://"):
            matches = _remote_glob(pattern)
        else:
            matches = sorted(glob.glob(pattern.removeprefix("file://")))
        matches = [m for m in matches if not m.endswith(_INDEX_SUFFIXES)]
        if not matches:
            raise StageInputError(f"input glob {pattern!r} matches no file")
        out.extend(matches)
    return sorted(dict.fromkeys(out))


def _remote_glob(pattern: str) -> list[str]:
    import pyarrow.fs as pafs

    scheme, _, rest = pattern.partition("://")
    parent, name = posixpath.split(rest)
    if any(c in parent for c in "*?["):
        raise StageInputError(f"input {pattern!r}: wildcards are supported in the file name only")
    fs, path = pafs.FileSystem.from_uri(f"{scheme}://{parent}")
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
    except (FileNotFoundError, OSError) as exc:
        raise StageInputError(f"input glob {pattern!r}: cannot list {scheme}://{parent}: {exc}") from exc
    return sorted(f"{scheme}://{parent}/{posixpath.basename(i.path)}" for i in infos
                  if i.type == pafs.FileType.File and fnmatch.fnmatch(posixpath.basename(i.path), name))


def _open_raw(uri: str):
    import smart_open  # here, not at import: its import takes ~1 s, which `bertpipe status` reads no dump for

    try:
        return smart_open.open(uri, "rb", compression="disable")
    except (FileNotFoundError, OSError, ValueError) as exc:
        raise StageInputError(f"cannot open input dump {uri}: {exc}") from exc


def _decompressing(raw, *, bz2_only: bool = False) -> io.BufferedIOBase:
    """Wrap by content (magic bytes), not file name: the gensim sample ends in `-shortened.bz2`, others in .xml."""
    if bz2_only:
        return bz2.BZ2File(raw)
    head = raw.read(3)
    stream = io.BufferedReader(_Prepend(head, raw), CHUNK_BYTES)  # no seek needed: works on HTTP streams too
    if head == b"BZh":
        return bz2.BZ2File(stream)  # reads concatenated streams, so multistream files need nothing special
    if head[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=stream)
    return stream


class _Prepend(io.RawIOBase):
    """`head` (already read to sniff the format) followed by the rest of `raw`."""

    def __init__(self, head: bytes, raw):
        self._head, self._raw = head, raw

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self._head:
            n = min(len(buf), len(self._head))
            buf[:n], self._head = self._head[:n], self._head[n:]
            return n
        data = self._raw.read(len(buf))
        buf[: len(data)] = data
        return len(data)


class _ByteRange(io.RawIOBase):
    """A read-only window [start, end) of a seekable file, for reading some bz2 streams of a multistream dump."""

    def __init__(self, raw, start: int, end: int):
        raw.seek(start)
        self._raw, self._left = raw, end - start

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = min(len(buf), self._left)
        data = self._raw.read(n) if n > 0 else b""
        buf[: len(data)] = data
        self._left -= len(data)
        return len(data)


class _PageHandler:
    """expat callbacks that collect <page> fields; finished pages queue in `self.pages`."""

    _FIELDS = {"title", "ns", "id", "text"}

    def __init__(self, max_page_bytes: int):
        self.max_chars = max_page_bytes  # chars <= bytes, so the UTF-8 cut below is exact and memory stays bounded
        self.max_bytes = max_page_bytes
        self.pages: list[Page] = []
        self.stack: list[str] = []
        self.last_id = -1
        self._reset()

    def _reset(self) -> None:
        self.fields: dict[str, list[str]] = {}
        self.redirect = False
        self.chars = 0
        self.over = False
        self.capture: list[str] | None = None

    def start(self, name: str, attrs) -> None:
        parent = self.stack[-1] if self.stack else ""
        self.stack.append(name)
        if name == "page":
            self._reset()
        elif name == "redirect" and parent == "page":
            self.redirect = True
        elif name in self._FIELDS and (parent == "page" or (name == "text" and parent == "revision")):
            if name == "text" and "text" in self.fields:
                self.capture = None  # several revisions (a full-history dump): keep the first text only
                return
            self.capture = self.fields.setdefault(name, [])

    def data(self, chunk: str) -> None:
        if self.capture is None:
            return
        if self.stack[-1] == "text":
            if self.chars > self.max_chars:
                self.over = True
                return
            self.chars += len(chunk)
        self.capture.append(chunk)

    def end(self, name: str) -> None:
        self.stack.pop()
        self.capture = None
        if name == "id" and self.stack and self.stack[-1] == "page":
            self.last_id = int("".join(self.fields.get("id", ["-1"])).strip() or -1)
        if name != "page":
            return
        f = self.fields
        text = "".join(f.get("text", ()))
        raw = text.encode("utf-8")
        truncated = self.over or len(raw) > self.max_bytes
        num_bytes = len(raw) if not self.over else max(len(raw), self.max_bytes + 1)
        if truncated:
            text = raw[: self.max_bytes].decode("utf-8", errors="ignore")
        ns_text = "".join(f.get("ns", ("0",))).strip()
        self.pages.append(Page(id=self.last_id, ns=int(ns_text or 0), title="".join(f.get("title", ())).strip(),
                               redirect=self.redirect, text=text, num_bytes=num_bytes, truncated=truncated))


def _parser(handler: _PageHandler):
    parser = xml.parsers.expat.ParserCreate()
    parser.buffer_text = True
    parser.buffer_size = 1 << 16
    parser.StartElementHandler = handler.start
    parser.EndElementHandler = handler.end
    parser.CharacterDataHandler = handler.data
    return parser


def iter_pages(unit: ReadUnit | str, *, max_page_bytes: int = 4_000_000) -> Iterator[Page]:
    """Pages of one dump (or one byte range of a multistream dump), in file order, streamed.

    Raises StageInputError naming the file (and the last page id read) on missing files, truncated or corrupt
    compression, malformed XML and unsupported encodings.
    """
    if isinstance(unit, str):
        unit = ReadUnit(unit)
    handler = _PageHandler(max_page_bytes)
    parser = _parser(handler)
    where = unit.uri if not unit.is_range else f"{unit.uri} [bytes {unit.start}-{unit.end}]"

    def fail(what: str, exc: Exception) -> StageInputError:
        after = f" after page id {handler.last_id}" if handler.last_id >= 0 else " before the first page"
        return StageInputError(f"{where}: {what}{after}: {exc}")

    raw = _open_raw(unit.uri)
    try:
        stream = (_decompressing(_ByteRange(raw, unit.start, unit.end), bz2_only=True) if unit.is_range
                  else _decompressing(raw))
        tail = b""
        if unit.is_range:
            # A range of page streams is an XML fragment: give it a root. The file's last stream closes
            # </mediawiki>, so the last bytes are held back and that closing tag is cut before the end.
            parser.Parse(b"<mediawiki>", False)
        while True:
            try:
                chunk = stream.read(CHUNK_BYTES)
            except (EOFError, OSError, ValueError) as exc:
                raise fail("truncated or corrupt compressed data", exc) from exc
            if not chunk:
                break
            if unit.is_range:
                chunk, tail = (tail + chunk)[:-64], (tail + chunk)[-64:]
            try:
                parser.Parse(chunk, False)
            except xml.parsers.expat.ExpatError as exc:
                raise fail("malformed XML", exc) from exc
            except (LookupError, ValueError) as exc:  # an encoding neither expat nor Python's codecs know
                raise fail("unsupported encoding", exc) from exc
            if handler.pages:
                yield from handler.pages
                handler.pages.clear()
        try:
            if unit.is_range:
                rest = tail.rstrip()
                if rest.endswith(b"</mediawiki>"):
                    rest = rest[: -len(b"</mediawiki>")]
                parser.Parse(rest + b"</mediawiki>", True)
            else:
                parser.Parse(b"", True)
        except xml.parsers.expat.ExpatError as exc:
            raise fail("malformed or truncated XML", exc) from exc
        yield from handler.pages
        handler.pages.clear()
    finally:
        raw.close()


HEAD_BYTES = 1 << 20
_HEAD_CHUNK = 16 << 10


class _HeadFound(Exception):
    """Raised from inside expat to stop reading once the first <page> has started."""


def check_dump_head(uri: str) -> None:
    """Before any Ray work: `uri` opens (bz2, gzip or plain), is XML whose root is <mediawiki>, and a <page> starts
    within its first HEAD_BYTES of XML. Reads only that head, so a bad dump costs milliseconds, not a Ray start-up
    and a failed task; a dump truncated further in is still found by `iter_pages`. StageInputError naming the file."""
    elements: list[str] = []

    def start(name: str, attrs) -> None:
        elements.append(name)
        if name == "page":
            raise _HeadFound

    parser = xml.parsers.expat.ParserCreate()
    parser.StartElementHandler = start
    raw = _open_raw(uri)
    seen = 0
    try:
        stream = _decompressing(raw)
        while seen < HEAD_BYTES:
            chunk = stream.read(_HEAD_CHUNK)
            if not chunk:
                break
            seen += len(chunk)
            parser.Parse(chunk, False)
            if elements and elements[0] != "mediawiki":
                break
    except _HeadFound:
        return
    except (EOFError, OSError, ValueError, LookupError) as exc:
        raise StageInputError(f"input dump {uri} is not a readable bz2/gzip/XML file: {exc}") from None
    except xml.parsers.expat.ExpatError as exc:
        raise StageInputError(f"input dump {uri} is not XML ({exc}): expected a MediaWiki XML dump") from None
    finally:
        raw.close()
    if seen == 0:
        raise StageInputError(f"input dump {uri} is empty")
    if not elements or elements[0] != "mediawiki":
        root = f"<{elements[0]}>" if elements else "no element"
        raise StageInputError(f"input dump {uri} is not a MediaWiki XML dump: its root is {root}, not <mediawiki>")
    raise StageInputError(f"input dump {uri} holds no <page> in its first {seen:,} bytes of XML: not a pages dump")


def find_index(uri: str) -> str | None:
    """The multistream index beside `uri` (`X-multistream.xml.bz2` -> `X-multistream-index.txt[.bz2]`), if any."""
    base = uri
    for suffix in (".xml.bz2", ".bz2"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    else:
        return None
    if not base.endswith("-multistream"):
        return None
    for suffix in _INDEX_SUFFIXES:
        candidate = base + suffix
        if storage.is_remote(candidate) and not candidate.startswith("file://"):
            import smart_open

            try:
                with smart_open.open(candidate, "rb", compression="disable"):
                    return candidate
            except Exception:  # noqa: BLE001 - any failure to open means "no index here"
                continue
        elif os.path.exists(candidate.removeprefix("file://")):
            return candidate
    return None


def read_stream_offsets(index_uri: str) -> list[int]:
    """Sorted distinct byte offsets of the page streams listed in a multistream index (`offset:page_id:title`)."""
    import smart_open

    offsets: set[int] = set()
    try:
        with smart_open.open(index_uri, "rt", encoding="utf-8", compression="infer_from_extension") as f:
            for line_no, line in enumerate(f, 1):
                head, sep, _ = line.partition(":")
                if not sep or not head.isdigit():
                    raise StageInputError(f"{index_uri}: line {line_no} is not 'offset:page_id:title'")
                offsets.add(int(head))
    except (EOFError, OSError) as exc:
        raise StageInputError(f"{index_uri}: cannot read multistream index: {exc}") from exc
    return sorted(offsets)


def plan_units(uri: str, size: int, *, target_bytes: int) -> list[ReadUnit]:
    """Split a multistream dump into ranges of whole streams of about `target_bytes`; other files stay whole."""
    index = find_index(uri)
    if index is None or size <= target_bytes:
        return [ReadUnit(uri)]
    offsets = [o for o in read_stream_offsets(index) if o < size]
    if not offsets:
        return [ReadUnit(uri)]
    # The header stream [0, offsets[0]) holds only <siteinfo>; the last range runs to EOF (footer stream).
    units, start = [], offsets[0]
    for off in offsets[1:]:
        if off - start >= target_bytes:
            units.append(ReadUnit(uri, start, off))
            start = off
    units.append(ReadUnit(uri, start, size))
    return units
