"""The search recipe: strict, its arms and candidates, and importable before Prefect starts."""

import subprocess
import sys

import pytest

from lrkv_tasks.recipes.search_recipe import SearchRecipe


def test_arms_are_caches_times_allocators_and_candidates_carry_the_rotation():
    recipe = SearchRecipe.model_validate(
        {
            "base": {"compression": {"rotation": "none"}},
            "search": {
                "caches": [{"name": "quantized", "bits": 3}, "dense"],
                "allocators": ["uniform", "fisher"],
                "ratios": [0.5, 0.25, 0.5],
                "rotation": "hadamard",
            },
        }
    )
    assert recipe.search.ratios == [0.25, 0.5]  # sorted, deduplicated
    arms = list(recipe.arms())
    assert arms == ["quantized(bits=3) uniform", "quantized(bits=3) fisher", "dense uniform", "dense fisher"]
    quantized = recipe.candidate(arms[1], 0.25)
    assert (quantized.ratio, quantized.allocator.name) == (0.25, "fisher")
    assert quantized.rotation.name == "hadamard"
    assert quantized.cache.to_dict()["bits"] == 3
    dense = recipe.candidate(arms[2], 0.5)
    assert (dense.cache.name, dense.rotation.name) == ("dense", "none")  # dense keeps the base's rotation


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"search": {"ratios": [0.0, 0.5]}}, "ratios must be in"),
        ({"search": {"ratios": [1.5]}}, "ratios must be in"),
        ({"search": {"max_ppl_rise": -0.01}}, "greater than or equal"),
        ({"search": {"max_rise": 0.01}}, "Extra inputs"),
        ({"search": {"caches": ["no-such-storage"]}}, "no-such-storage"),
        ({"base": {"eval": {"dataset": None}}}, "base.eval.dataset cannot be null"),
    ],
)
def test_invalid_recipes_fail(bad, message):
    with pytest.raises(ValueError, match=message):
        SearchRecipe.model_validate(bad)


def test_the_recipe_does_not_import_prefect():
    """The CLI validates it before pointing Prefect at its API; importing Prefect first would fix the API."""
    code = "import sys, lrkv_tasks.recipes.search_recipe; print('prefect' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
