"""Ray Data reads of the project's own Parquet files (the clean stage's documents, the pairs stage's shards)."""
from __future__ import annotations


def read_parquet(files: list[str], columns: list[str]):
    """A Ray dataset of `columns` of `files`, through Ray Data's first Parquet reader: in file order where its
    execution preserves order (`execution_options.preserve_order`, as the pre-training stage's split sets it).

    Ray 2.60's default reader (DataSourceV2) starts a pool of 32 footer-reading actors, each a Python process, for
    every read, whatever the number of files: the pre-training stage's four streams started 128 processes and took
    43 s to open on a 2-core machine, 7 to 8.6 s with this reader (benchmarks/README.md, "Opening the data
    streams"). Our files are few and listed by their manifest, so nothing is lost: no footer statistics are needed
    to plan them. The flag is read when the read is planned, here, on the driver (reads are planned one at a time).
    """
    import ray.data

    context = ray.data.DataContext.get_current()
    chosen = context.use_datasource_v2
    context.use_datasource_v2 = False  # read at plan time only, here; restored for whoever shares the context
    try:
        return ray.data.read_parquet(files, columns=columns)
    finally:
        context.use_datasource_v2 = chosen
