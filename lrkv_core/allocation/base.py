"""The allocator interface and its registry.

An allocator is a registered :class:`~lrkv_core.registry.Method`: its dataclass fields are its options, its
``needs`` names the per-group features it reads besides the spectra (computed per layer by
:mod:`lrkv_core.allocation.features`), and :meth:`Allocator.allocate` proposes ranks on the grid of
allowed ranks and makes them meet the budget with the shared rule
(:func:`lrkv_core.allocation.problem.fit_to_budget`). Adding one is one file in this package with
``@ALLOCATORS.register`` and an import line in ``__init__.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from ..registry import Method, Registry
from .problem import RankProblem

Allocation = tuple[list[int], dict[str, Any]]  # flat ranks in problem.groups order, details for the plan

# what a conversion uses unless told otherwise: chosen by measurement on two models at three ratios
# (docs/allocation.md); it needs calibration rows (one gradient pass), as the default decomposition does
DEFAULT_ALLOCATOR = "kl"


@dataclass(frozen=True)
class Allocator(Method, ABC):
    """Chooses a rank per (layer, K/V, group) for a kept-width budget."""

    needs: ClassVar[frozenset[str]] = frozenset()  # features besides the spectra, e.g. {"fisher_sums"}
    # Gauss–Newton steps a conversion refines this allocator's plan by unless told
    # (lrkv_core.conversion.refine)
    refine_steps: ClassVar[int] = 0

    @abstractmethod
    def allocate(self, problem: RankProblem) -> Allocation:
        """Flat ranks in ``problem.groups`` order (meeting the budget) and details for the plan."""

    def run(self, problem: RankProblem) -> Allocation:
        """Check the inputs and feasibility, allocate, and check the budget was met.

        When every group fits at its max rank (ratio 1.0) there is nothing to choose: each keeps its max
        rank and no feature is read, so a full-rank conversion needs no allocator statistics.
        """
        full = [problem.max_rank(i) for i in range(len(problem.groups))]
        if sum(full) <= problem.budget:
            return full, {"every_group_at_max_rank": True}
        missing = sorted(self.needs - set(problem.features))
        if missing:
            raise ValueError(
                f"allocator {self.name!r} needs the feature(s) {missing} (computed from calibration "
                "statistics: see lrkv_core.allocation.features)"
            )
        problem.check_feasible()
        ranks, details = self.allocate(problem)
        if sum(ranks) > problem.budget:
            raise AssertionError(
                f"allocator {self.name} exceeded the budget: {sum(ranks)} > {problem.budget}"
            )
        return ranks, details


ALLOCATORS: Registry[Allocator] = Registry("allocator", Allocator)
