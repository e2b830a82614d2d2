"""pipeline/framework/ray_reads.py: the project's Parquet files reach Ray Data in file order, with the chosen
columns, and without the footer-reading actor pool of Ray Data's default reader (32 processes per read)."""
import pyarrow as pa
import pyarrow.parquet as pq


def footer_readers() -> int:
    """Footer-reading actors this Ray has ever started (from its control store: no dashboard needed)."""
    from ray._private import state

    return sum("FooterReader" in a.get("ActorClassName", "") for a in state.actors().values())


def test_rows_come_in_file_order_with_the_columns_asked_and_no_footer_actors(tmp_path, ray_local):
    import ray.data

    from bertpipe.pipeline.framework.ray_reads import read_parquet

    files = []
    for i in range(3):
        path = tmp_path / f"part-{i}.parquet"
        pq.write_table(pa.table({"id": list(range(10 * i, 10 * i + 10)), "text": [f"t{i}"] * 10,
                                 "unused": [0.5] * 10}), path)
        files.append(str(path))
    before = footer_readers()
    context = ray.data.DataContext.get_current()
    chosen = context.use_datasource_v2
    dataset = read_parquet(files[::-1], ["id", "text"])
    # file order where the run keeps Ray Data's order (the pre-training stage's split does): without it a read
    # task that finishes first comes first, which a loaded machine showed
    dataset.context.execution_options.preserve_order = True
    rows = dataset.take_all()
    assert [r["id"] for r in rows] == [*range(20, 30), *range(10, 20), *range(0, 10)]
    assert set(rows[0]) == {"id", "text"}
    assert footer_readers() == before
    assert context.use_datasource_v2 == chosen  # the shared context is left as found
