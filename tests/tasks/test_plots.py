"""Rank-plan heatmap: a readable PNG, for small and large plans."""

from __future__ import annotations

import matplotlib.image
import numpy as np

from lrkv_core.allocation import RankPlan
from lrkv_tasks.tracking.plots import plot_rank_heatmap, rank_matrix


def _plan(n_layers: int, n_groups: int, width: int = 32) -> RankPlan:
    ranks = {
        kind: [
            [8 * ((layer + g + (kind == "v")) % 4 + 1) for g in range(n_groups)] for layer in range(n_layers)
        ]
        for kind in "kv"
    }
    return RankPlan({"name": "fisher"}, 2, width, 8, 0.6, ranks)


def test_rank_matrix_puts_k_groups_then_v_groups() -> None:
    plan = RankPlan({"name": "uniform"}, 1, 16, 8, 0.5, {"k": [[8, 16], [8, 8]], "v": [[16, 8], [8, 16]]})
    matrix, labels = rank_matrix(plan)
    assert labels == ["K0", "K1", "V0", "V1"]
    assert np.array_equal(matrix, [[8, 16, 16, 8], [8, 8, 8, 16]])
    assert rank_matrix(RankPlan({"name": "uniform"}, 2, 16, 8, 0.5, {"k": [[8]], "v": [[16]]}))[1] == [
        "K",
        "V",
    ]


def test_heatmap_png_is_written_and_readable(tmp_path) -> None:
    for name, plan in (("small", _plan(4, 2)), ("large", _plan(40, 16))):
        out = plot_rank_heatmap(plan, tmp_path / f"{name}.png")
        assert out == tmp_path / f"{name}.png" and out.stat().st_size > 5_000
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(out)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
        assert image[..., :3].std() > 0.05  # not a blank canvas
