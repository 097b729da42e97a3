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


def test_the_gate_bounds_the_kl_to_the_original_when_asked():
    close = Q | {"kl": 0.02}
    assert quality_gate(close, None, 0.05, max_kl=0.05) == (
        True,
        "perplexity rise +4.00% within 5.00%, KL 0.02000 within 0.05, first champion",
    )
    ok, why = quality_gate(close, None, 0.05, max_kl=0.01)
    assert not ok and why == "KL to the original 0.02000 nats/token exceeds the gate's 0.01"
    ok, why = quality_gate(Q, None, 0.05, max_kl=0.05)  # a bound on KL needs KL measured
    assert not ok and "KL to the original was not measured" in why
    assert quality_gate(close, None, 0.05)[0]  # no bound by default


def test_a_lora_recovery_that_moves_away_from_the_original_never_makes_a_champion():
    """Lower perplexity than the original's (fitting the text's domain) with a KL that rose is refused; a
    recovery that brought the model closer passes."""
    fitted = {"ppl": 8.1, "base_ppl": 10.0, "protocol": "p1", "kl": 0.343, "before_lora_kl": 0.170}
    ok, why = quality_gate(fitted, None, 0.05)
    assert not ok and "LoRA recovery moved the model away from the original (KL 0.17000 → 0.34300" in why
    assert "lora.objective=distill" in why
    assert quality_gate(fitted | {"kl": 0.134}, None, 0.05)[0]


def test_the_champion_is_beaten_on_kl_to_the_original_where_both_measured_it():
    champion = {"version": "2", "ppl": 10.3, "protocol": "p1", "kl": 0.05}
    ok, why = quality_gate(Q | {"kl": 0.04}, champion, 0.05)  # higher PPL, closer to the original
    assert ok and why.endswith("closer to the original than champion v2")
    ok, why = quality_gate({**Q, "ppl": 10.1, "kl": 0.06}, champion, 0.05)  # lower PPL, further away
    assert not ok and why == "KL to the original 0.06000 nats/token does not beat champion v2's 0.05000"
    old = champion | {"kl": None}  # a champion registered without its KL: compared on perplexity
    assert not quality_gate(Q | {"kl": 0.04}, old, 0.05)[0]
    assert quality_gate({**Q, "ppl": 10.2, "kl": 0.04}, old, 0.05)[0]


def test_the_quality_carries_the_kl_before_and_after_lora():
    def result(ppl, kl=None):
        parts = {"ppl": ppl, "protocol": {"dataset": "text:b.txt"}}
        return EvalResult("m", parts, {}, {}, None if kl is None else {"kl": kl, "top1_agreement": 0.9})

    base = result(10.0)
    assert "kl" not in quality(base, result(10.2))
    assert quality(base, result(10.2, 0.03)) | {"protocol": None} == {
        "ppl": 10.2,
        "base_ppl": 10.0,
        "protocol": None,
        "kl": 0.03,
    }
    q = quality(base, result(10.2, 0.03), before_lora=result(10.6, 0.05))
    assert (q["kl"], q["before_lora_kl"]) == (0.03, 0.05)
