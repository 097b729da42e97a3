import pytest
from pydantic import ValidationError

from lrkv_tasks.recipe import ConvertRecipe, flatten, load_recipe


def test_defaults_are_the_embedded_quickstart():
    r = ConvertRecipe()
    assert r.model == "builtin:pydoc-llama"
    assert r.calibration.dataset.startswith("builtin:") and r.eval.dataset.startswith("builtin:")
    assert r.compression.name == "palu" and r.compression.ratio == 0.5


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("model: some/model\ncompression:\n  ratio: 0.7\n  group_size: 2\n")
    r = load_recipe(p, {"compression.ratio": 0.3, "eval.max_windows": 4})
    assert (r.model, r.compression.ratio, r.compression.group_size, r.eval.max_windows) == (
        "some/model",
        0.3,
        2,
        4,
    )


@pytest.mark.parametrize(
    "text",
    [
        "modle: x\n",  # typo at top level
        "compression:\n  ratoi: 0.5\n",  # typo in a section
        "compression:\n  name: gear\n",  # unknown method
        "compression:\n  ratio: 1.5\n",  # out of range
        "eval:\n  seq_len: 64\n  decode_prefix: 64\n",  # prefix outside the window
    ],
)
def test_strict_recipes_fail_loudly(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    with pytest.raises(ValidationError):
        load_recipe(p)


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}
