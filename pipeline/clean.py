"""The `clean` stage: Wikipedia XML dumps -> Parquet documents (id int64, title string, text string).

Ray Data plan: one input row per read unit (a dump, or a byte range of whole bz2 streams of a multistream dump)
-> flat_map `read_and_clean_unit`: streams pages (`read_unit_rows`, text of redirects and other namespaces dropped
at once) and cleans them 64 at a time (`clean_pages_batch`, pure) in the same task -> materialize -> counts by status
-> articles sorted by id, written as `docs-00000.parquet`... of `rows_per_file` rows each, so two runs on the
same dumps give byte-identical content whatever the task scheduling was.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bertpipe.pipeline import storage
from bertpipe.pipeline.config import CleanConfig
from bertpipe.pipeline.identity import describe_file
from bertpipe.pipeline.progress import Reporter, remote_progress
from bertpipe.pipeline.dump_reader import ReadUnit, expand_inputs, iter_pages, plan_units
from bertpipe.pipeline.stage import StageContext, StageInputError, StageResult
from bertpipe.pipeline.wikitext import is_disambiguation, wikitext_to_paragraphs

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


def read_and_clean_unit(unit: dict[str, Any], *, max_page_bytes: int, pages_per_batch: int,
                        progress: Reporter | None = None, **clean_kwargs: Any) -> Iterator[dict[str, Any]]:
    """flat_map: read one unit and clean its pages `pages_per_batch` at a time, in the same task, so raw wikitext
    never goes through the object store (two operators were not fused by Ray Data and moved every page twice)."""
    def cleaned(rows: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        batch = {k: np.array([r[k] for r in rows], dtype=object) for k in rows[0]}
        for k in ("id", "ns", "num_bytes"):
            batch[k] = batch[k].astype(np.int64)
        for k in ("redirect", "truncated"):
            batch[k] = batch[k].astype(bool)
        out = clean_pages_batch(batch, **clean_kwargs)
        if progress is not None:
            progress.add(float(batch["num_bytes"].sum()) / 1e6)
        keys = list(out)
        for values in zip(*(out[k] for k in keys)):
            yield dict(zip(keys, values))

    rows: list[dict[str, Any]] = []
    for row in read_unit_rows(unit, max_page_bytes=max_page_bytes):
        rows.append(row)
        if len(rows) == pages_per_batch:
            yield from cleaned(rows)
            rows = []
    if rows:
        yield from cleaned(rows)


def _articles_only(table: pa.Table) -> pa.Table:
    import pyarrow.compute as pc

    return table.filter(pc.equal(table["status"], ARTICLE)).select(["id", "title", "text"])


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
    return found


def _write_documents(ds, output_uri: str, rows_per_file: int) -> list[str]:
    fs, root = storage.resolve(output_uri)
    fs.create_dir(root, recursive=True)
    names = []
    for i, batch in enumerate(ds.iter_batches(batch_size=rows_per_file, batch_format="pyarrow")):
        name = f"docs-{i:05d}.parquet"
        path = storage.join(root, name) if "://" not in output_uri else f"{root}/{name}"
        with fs.open_output_stream(path + ".tmp") as f:
            pq.write_table(batch.select(["id", "title", "text"]).cast(DOC_SCHEMA), f, compression="zstd")
        fs.move(path + ".tmp", path)
        names.append(name)
    return names


def _read_and_clean(units: list[ReadUnit], cfg: CleanConfig):
    """Every unit read and cleaned by Ray Data tasks (materialized: the counts and the sort read it twice)."""
    import ray

    with remote_progress("clean", None, "MB wikitext") as progress:
        ds = ray.data.from_items([{"uri": u.uri, "start": u.start, "end": u.end} for u in units],
                                 override_num_blocks=len(units))
        ds = ds.flat_map(read_and_clean_unit, concurrency=cfg.num_read_workers or None,
                         fn_kwargs={"max_page_bytes": cfg.max_page_bytes, "pages_per_batch": cfg.pages_per_batch,
                                    "min_paragraph_chars": cfg.min_paragraph_chars,
                                    "min_article_chars": cfg.min_article_chars,
                                    "skip_disambiguation": cfg.skip_disambiguation, "progress": progress})
        ds.set_name("clean: read + clean pages")  # what the Ray dashboard's Data page shows
        return ds.materialize()


def run_stage(ctx: StageContext) -> StageResult:
    cfg: CleanConfig = ctx.config["clean"]
    started = time.perf_counter()
    raw_inputs = describe_raw_inputs(cfg)
    units: list[ReadUnit] = []
    for item in raw_inputs:
        units.extend(plan_units(item["uri"], item["size"], target_bytes=cfg.split_bytes))
    log.info("clean: %d dump(s), %d read unit(s)", len(raw_inputs), len(units))

    try:
        pages = _read_and_clean(units, cfg)
        counts: Counter[str] = Counter()
        per_source: Counter[str] = Counter()
        num_bytes = truncated = 0
        for b in pages.select_columns(["status", "wikitext_bytes", "truncated", "source"]) \
                .iter_batches(batch_size=65_536, batch_format="numpy"):
            counts.update(b["status"].tolist())
            per_source.update(b["source"].tolist())
            num_bytes += int(b["wikitext_bytes"].sum())
            truncated += int(b["truncated"].astype(bool).sum())
        empty = [item["uri"] for item in raw_inputs if per_source[item["uri"]] == 0]
        if empty:
            raise StageInputError(f"no articles: input dump {empty[0]} holds no pages")
        if counts[ARTICLE] == 0:
            raise StageInputError(f"no articles kept from {[i['uri'] for i in raw_inputs]} "
                                  f"({sum(counts.values())} pages seen: {dict(counts)})")
        log.info("clean: %d pages -> %d articles; writing files of %d rows", sum(counts.values()), counts[ARTICLE],
                 cfg.rows_per_file)
        docs = pages.map_batches(_articles_only, batch_format="pyarrow").sort("id")
        files = _write_documents(docs, ctx.output_uri, cfg.rows_per_file)
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
        "mb_per_second": round(num_bytes / 1e6 / seconds, 3), "articles_per_second": round(counts[ARTICLE] / seconds, 2),
        "num_input_files": len(raw_inputs), "num_read_units": len(units), "num_output_files": len(files),
    }
    log.info("clean: done in %.1fs: %s", seconds, metrics)
    ctx.log_metrics(metrics, None)
    return StageResult(num_rows=counts[ARTICLE], metrics=metrics, raw_inputs=raw_inputs, outputs=files)
