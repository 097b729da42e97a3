"""The quality gate that decides the ``champion`` alias, and the registered model's name."""

from lrkv_core.data.heldout import overlap
from lrkv_core.evaluation.metrics import EvalResult
from lrkv_tasks.publish import quality
from lrkv_tasks.tracking.model_registry import model_name, quality_gate

Q = {"ppl": 10.4, "base_ppl": 10.0, "protocol": "p1"}


def test_the_gate_bounds_the_perplexity_rise():
    assert quality_gate(Q, None, 0.05) == (True, "perplexity rise +4.00% within 5.00%, first champion")
    ok, why = quality_gate(Q, None, 0.03)
    assert not ok and why == "perplexity rise +4.00% exceeds the gate's 3.00%"
    assert quality_gate(None, None, 0.05) == (False, "not evaluated")


def test_the_gate_promotes_only_over_a_worse_champion_on_the_same_protocol():
    worse = {"version": "3", "ppl": 10.5, "protocol": "p1"}
    better = {"version": "4", "ppl": 10.3, "protocol": "p1"}
    assert quality_gate(Q, worse, 0.05)[0]
    ok, why = quality_gate(Q, better, 0.05)
    assert not ok and "does not beat champion v4" in why
    ok, why = quality_gate(Q, {**worse, "protocol": "p2"}, 0.05)
    assert not ok and "another protocol" in why


def test_model_names_are_slugs_of_the_reference():
    assert model_name("meta-llama/Llama-2-7b-hf") == "lrkv-llama-2-7b-hf"
    assert model_name("builtin:pydoc-llama") == "lrkv-pydoc-llama"
    assert model_name("/tmp/x/tiny_llama/") == "lrkv-tiny-llama"


def test_evaluation_data_that_overlaps_the_calibration_data_never_makes_a_champion():
    base, ev = (
        EvalResult("m", {"ppl": p, "protocol": {"dataset": "text:a.txt"}}, {}, {}) for p in (10.0, 10.1)
    )
    clash = overlap("text:a.txt", "text:a.txt[90%:]")
    assert clash is not None and "overlaps the calibration data text:a.txt" in clash
    assert quality_gate(quality(base, ev), None, 0.05)[0]  # the same numbers pass on held-out data
    assert quality_gate(quality(base, ev, clash), None, 0.05) == (False, clash)
    assert overlap("text:a.txt[:90%]", "text:a.txt[90%:]") is None
