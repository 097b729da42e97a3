"""Rank allocation: the rank problem and its one budget rule, the plan, and one file per allocator.

Add an allocator: a new file here with a frozen dataclass ``@ALLOCATORS.register``-ed (its fields are its
options, ``needs`` the features it reads) and its import below. Recipes, the CLI and the flow pick it up.
"""

from . import curves, eigen, fisher, lorc, uniform  # noqa: F401  (registration)
from .base import ALLOCATORS, DEFAULT_ALLOCATOR, Allocation, Allocator
from .eigen import relative_errors
from .features import FEATURES, Feature, LayerSummary, register_feature, statistics_for, summarize_layer
from .plan import RankPlan, allocate_ranks, plan_from_summaries
from .problem import KINDS, GroupSpec, RankProblem, Ranks, Spectra, fit_to_budget, round_rank

__all__ = [
    "ALLOCATORS",
    "DEFAULT_ALLOCATOR",
    "FEATURES",
    "KINDS",
    "Allocation",
    "Allocator",
    "Feature",
    "GroupSpec",
    "LayerSummary",
    "RankPlan",
    "RankProblem",
    "Ranks",
    "Spectra",
    "allocate_ranks",
    "fit_to_budget",
    "plan_from_summaries",
    "register_feature",
    "relative_errors",
    "round_rank",
    "statistics_for",
    "summarize_layer",
]
