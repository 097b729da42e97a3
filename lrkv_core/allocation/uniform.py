"""``uniform``: every group keeps the same fraction of its width."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import ALLOCATORS, Allocation, Allocator
from .problem import RankProblem, ranks_from_targets


@ALLOCATORS.register
@dataclass(frozen=True)
class Uniform(Allocator):
    """every group keeps ratio × its width (leftover steps go in order)"""

    name: ClassVar[str] = "uniform"

    def allocate(self, problem: RankProblem) -> Allocation:
        targets = [problem.ratio * problem.group_width] * len(problem.groups)
        return ranks_from_targets(problem, targets), {}
