"""The `clean` stage: Wikipedia XML dumps -> Parquet documents (id int64, title string, text string).

Ray Data plan, one pass: one input row per read unit (a dump, or a byte range of whole bz2 streams of a
multistream dump) -> `map(clean_and_write_unit)`: the task streams the unit's pages (`read_unit_rows`, text of
redirects and other namespaces dropped at once), cleans them `pages_per_batch` at a time (`clean_pages_batch`,
pure) and writes the articles itself, in dump order, as `docs-{unit:05d}-{part:04d}.parquet` of at most
`rows_per_file` rows (row groups of `ROW_GROUP_ROWS`, the grain the vocab stage samples at). Only a row of
counts per unit reaches the driver: memory stays one batch per task and nothing goes through the object store,
whatever the corpus size. File names and contents depend on the unit, not on scheduling, so two runs on the same
dumps give byte-identical files, and a retried task rewrites the same files.
"""
from __future__ import annotations

import logging
import re
import time
from collections import Counter
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.stages.config import CleanConfig
from bertpipe.pipeline.framework.identity import describe_file
from bertpipe.pipeline.framework.console import Console
from bertpipe.pipeline.framework.progress import Reporter
from bertpipe.pipeline.stages.dump_reader import ReadUnit, check_dump_head, expand_inputs, iter_pages, plan_units
from bertpipe.pipeline.framework.stage import StageContext, StageInputError, StageResult
from bertpipe.pipeline.stages.wikitext import is_disambiguation, wikitext_to_paragraphs

log = logging.getLogger(__name__)

DOC_SCHEMA = pa.schema([("id", pa.int64()), ("title", pa.string()), ("text", pa.string())])
# Status of every page seen; only "article" rows become documents.
ARTICLE, REDIRECT, OTHER_NS, DISAMBIGUATION, TOO_SHORT = "article", "redirect", "non_article_ns", "disambiguation", \
    "too_short"


def describe_raw_inputs(cfg: CleanConfig) -> list[dict[str, Any]]:
    """[{"uri", "size", "checksum"}] of every dump `cfg.input` names (globs expanded), for the stage fingerprint."""
    try:
        return [describe_file(uri, what="input dump") for uri in expand_inputs(cfg.input)]
    except StageInputError as exc:
        if "does not exist" in str(exc) or "matches no file" in str(exc):
            raise StageInputError(f"{exc} (set clean.input to a Wikipedia dump; for the bundled sample run "
                                  "`bertpipe fetch-sample` first)") from None
        raise


def preflight(ctx: StageContext) -> None:
    """Before Ray starts: every dump exists (describe_raw_inputs, run by the plan) and its head is a MediaWiki
    pages dump, so an empty, non-bz2 or non-Wikipedia file fails in milliseconds with one line."""
    for uri in expand_inputs(ctx.section(CleanConfig).input):
        check_dump_head(uri)


# ---------------------------------------------------------------- pure per-row / per-batch functions

def read_unit_rows(unit: dict[str, Any], *, max_page_bytes: int) -> Iterator[dict[str, Any]]:
    """flat_map: every page of one read unit. Text of redirects and non-article namespaces is dropped here so it
    never travels through the object store."""
    for page in iter_pages(ReadUnit(unit["uri"], unit["start"], unit["end"]), max_page_bytes=max_page_bytes):
        keep = page.ns == 0 and not page.redirect
        yield {"id": page.id, "ns": page.ns, "title": page.title, "redirect": page.redirect,
               "text": page.text if keep else "", "num_bytes": page.num_bytes, "truncated": page.truncated,
               "source": unit["uri"]}


def clean_pages_batch(batch: dict[str, np.ndarray], *, min_paragraph_chars: int, min_article_chars: int,
                      skip_disambiguation: bool) -> dict[str, np.ndarray]:
    """One batch of pages (column arrays): wikitext -> plain text, and a status per page saying why it was kept
    or skipped."""
    texts, statuses = [], []
    for ns, redirect, title, wikitext in zip(batch["ns"], batch["redirect"], batch["title"], batch["text"]):
        text, status = "", ARTICLE
        if ns != 0:
            status = OTHER_NS
        elif redirect:
            status = REDIRECT
        elif skip_disambiguation and is_disambiguation(title, wikitext):
            status = DISAMBIGUATION
        else:
            text = "\n".join(wikitext_to_paragraphs(wikitext, min_paragraph_chars=min_paragraph_chars))
            if len(text) < min_article_chars:
                text, status = "", TOO_SHORT
        texts.append(text)
        statuses.append(status)
    return {"id": np.asarray(batch["id"], dtype=np.int64), "title": batch["title"],
            "text": np.asarray(texts, dtype=object), "status": np.asarray(statuses, dtype=object),
            # wikitext the cleaner had to read (articles and the pages it judged): the throughput denominator
            "wikitext_bytes": np.where((batch["ns"] == 0) & ~batch["redirect"].astype(bool), batch["num_bytes"], 0),
            "truncated": batch["truncated"], "source": batch["source"]}


# ---------------------------------------------------------------- Ray wrapper

def _input_error_in(exc: BaseException) -> StageInputError | None:
    """The StageInputError a Ray task raised, dug out of RayTaskError / UserCodeException wrappers."""
    seen, todo, found = set(), [exc], None
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        wrapper = any(c.__name__ in ("RayTaskError", "UserCodeException") for c in type(e).__mro__)
        if isinstance(e, StageInputError) and not wrapper:
            found = e  # the original, whose message is clean; wrappers that subclass it carry tracebacks
        todo.extend([e.__cause__, e.__context__, getattr(e, "cause", None)])
    if found is None:
        # Ray Data's `map` wraps a task's error in a UserCodeException that does not carry the original across
        # processes; only its rendered traceback does, ending with our class name and message.
        rendered = re.findall(r"StageInputError: ([^\n]+)", str(exc))
        found = StageInputError(rendered[-1]) if rendered else None
    return found


ROW_GROUP_ROWS = 1_000
_STATUSES = (ARTICLE, REDIRECT, OTHER_NS, DISAMBIGUATION, TOO_SHORT)


class _DocWriter:
    """Articles of one read unit into `docs-{unit}-{part}.parquet` files of at most `rows_per_file` rows; each file
    is written under a temporary name unique to this write (storage.temp_path) and renamed when whole."""

    def __init__(self, output_uri: str, unit_index: int, rows_per_file: int):
        self.output_uri, self.unit_index, self.rows_per_file = output_uri, unit_index, rows_per_file
        self.names: list[str] = []
        self._writer = self._stream = None
        self._rows = 0

    def add(self, table: pa.Table) -> None:
        while table.num_rows:
            if self._writer is None:
                self._open()
            take = min(table.num_rows, self.rows_per_file - self._rows)
            self._writer.write_table(table.slice(0, take), row_group_size=ROW_GROUP_ROWS)
            self._rows += take
            table = table.slice(take)
            if self._rows == self.rows_per_file:
                self.close()

    def _open(self) -> None:
        name = f"docs-{self.unit_index:05d}-{len(self.names):04d}.parquet"
        fs, path = storage.resolve(storage.join(self.output_uri, name))
        self._path, self._fs = path, fs
        self._tmp = storage.temp_path(path)
        self._stream = fs.open_output_stream(self._tmp)
        self._writer = pq.ParquetWriter(self._stream, DOC_SCHEMA, compression="zstd")
        self.names.append(name)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._stream.close()
            self._fs.move(self._tmp, self._path)
        self._writer = self._stream = None
        self._rows = 0


def clean_and_write_unit(unit: dict[str, Any], *, output_uri: str, rows_per_file: int, max_page_bytes: int,
                         pages_per_batch: int, progress: Reporter | None = None,
                         **clean_kwargs: Any) -> dict[str, Any]:
    """Ray Data `map`: read, clean and write one unit; returns its counts (one small row per unit)."""
    counts = dict.fromkeys(_STATUSES, 0)
    wikitext_bytes = truncated = 0
    writer = _DocWriter(output_uri, int(unit["index"]), rows_per_file)
    batch: list[dict[str, Any]] = []

    def flush() -> None:
        nonlocal wikitext_bytes, truncated
        cols = {k: np.array([r[k] for r in batch], dtype=object) for k in batch[0]}
        for k in ("id", "ns", "num_bytes"):
            cols[k] = cols[k].astype(np.int64)
        for k in ("redirect", "truncated"):
            cols[k] = cols[k].astype(bool)
        out = clean_pages_batch(cols, **clean_kwargs)
        for status in out["status"]:
            counts[status] += 1
        wikitext_bytes += int(out["wikitext_bytes"].sum())
        truncated += int(out["truncated"].sum())
        keep = out["status"] == ARTICLE
        if keep.any():
            writer.add(pa.table({"id": out["id"][keep], "title": out["title"][keep].tolist(),
                                 "text": out["text"][keep].tolist()}, schema=DOC_SCHEMA))
        if progress is not None:
            progress.add(float(cols["num_bytes"].sum()) / 1e6)
        batch.clear()

    for row in read_unit_rows(unit, max_page_bytes=max_page_bytes):
        batch.append(row)
        if len(batch) == pages_per_batch:
            flush()
    if batch:
        flush()
    writer.close()
    return {"uri": unit["uri"], "index": unit["index"], "files": writer.names, "wikitext_bytes": wikitext_bytes,
            "truncated": truncated, **{f"n_{k}": v for k, v in counts.items()}}


def _clean_units(units: list[ReadUnit], cfg: CleanConfig, output_uri: str,
                 console: Console) -> list[dict[str, Any]]:
    """Every unit read, cleaned and written by Ray Data tasks; their count rows, in unit order."""
    import ray

    fs, root = storage.resolve(output_uri)
    fs.create_dir(root, recursive=True)
    with console.remote_progress("clean", None, "MB wikitext") as progress:
        ds = ray.data.from_items([{"uri": u.uri, "start": u.start, "end": u.end, "index": i}
                                  for i, u in enumerate(units)], override_num_blocks=len(units))
        ds = ds.map(clean_and_write_unit, concurrency=cfg.num_read_workers or None,
                    fn_kwargs={"output_uri": output_uri, "rows_per_file": cfg.rows_per_file,
                               "max_page_bytes": cfg.max_page_bytes, "pages_per_batch": cfg.pages_per_batch,
                               "min_paragraph_chars": cfg.min_paragraph_chars,
                               "min_article_chars": cfg.min_article_chars,
                               "skip_disambiguation": cfg.skip_disambiguation, "progress": progress})
        ds.set_name("clean: read + clean + write")  # what the Ray dashboard's Data page shows
        return sorted(ds.take_all(), key=lambda r: int(r["index"]))


def run_stage(ctx: StageContext) -> StageResult:
    cfg = ctx.section(CleanConfig)
    started = time.perf_counter()
    raw_inputs = describe_raw_inputs(cfg)
    units: list[ReadUnit] = []
    for item in raw_inputs:
        units.extend(plan_units(item["uri"], item["size"], target_bytes=cfg.split_bytes))
    log.info("clean: %d dump(s), %d read unit(s)", len(raw_inputs), len(units))

    try:
        rows = _clean_units(units, cfg, ctx.output_uri, ctx.console)
        counts: Counter[str] = Counter()
        per_source: Counter[str] = Counter()
        for r in rows:
            counts.update({k: r[f"n_{k}"] for k in _STATUSES})
            per_source[r["uri"]] += sum(r[f"n_{k}"] for k in _STATUSES)
        num_bytes = sum(r["wikitext_bytes"] for r in rows)
        truncated = sum(r["truncated"] for r in rows)
        files = [str(name) for r in rows for name in list(r["files"])]
        empty = [item["uri"] for item in raw_inputs if per_source[item["uri"]] == 0]
        if empty:
            raise StageInputError(f"no articles: input dump {empty[0]} holds no pages")
        if counts[ARTICLE] == 0:
            raise StageInputError(f"no articles kept from {[i['uri'] for i in raw_inputs]} "
                                  f"({sum(counts.values())} pages seen: {dict(counts)})")
        log.info("clean: %d pages -> %d articles in %d files", sum(counts.values()), counts[ARTICLE], len(files))
    except Exception as exc:  # noqa: BLE001 - only to unwrap; anything else re-raises untouched
        inner = _input_error_in(exc)
        if inner is None or inner is exc:
            raise
        # Ray appends retry advice to the message; the first line is ours and names the file.
        message = str(inner.args[0] if inner.args else inner).split("\n", 1)[0]
        raise StageInputError(message) from None

    seconds = time.perf_counter() - started
    metrics = {
        "pages_seen": sum(counts.values()), "articles": counts[ARTICLE],
        "redirects_skipped": counts[REDIRECT], "disambiguation_skipped": counts[DISAMBIGUATION],
        "non_article_ns_skipped": counts[OTHER_NS], "too_short_skipped": counts[TOO_SHORT],
        "pages_truncated": truncated, "mb_wikitext": round(num_bytes / 1e6, 3), "seconds": round(seconds, 3),
        "mb_per_second": round(num_bytes / 1e6 / seconds, 3),
        "articles_per_second": round(counts[ARTICLE] / seconds, 2),
        "num_input_files": len(raw_inputs), "num_read_units": len(units), "num_output_files": len(files),
    }
    log.info("clean: done in %.1fs: %s", seconds, metrics)
    ctx.log_metrics(metrics, None)
    return StageResult(num_rows=counts[ARTICLE], metrics=metrics, raw_inputs=raw_inputs, outputs=files)
