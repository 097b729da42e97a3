"""The ablation table as a user reads it when conversions of the grid fail."""

from lrkv_tasks.ablation import to_markdown


def test_a_grid_where_every_row_failed_shows_each_rows_error():
    point = {"decomposition": "plain", "group_size": 1, "allocator": "uniform"}
    rows = [point | {"ratio": r, "error": f"ratio {r} bad"} for r in (0.001, 0.002)]
    table = to_markdown(rows, {})
    assert "ratio 0.001 bad" in table and "ratio 0.002 bad" in table
    assert "No row succeeded" in table and "Original model" not in table
