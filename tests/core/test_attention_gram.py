"""The attention-mixed Gram (statistic ``attention_gram``) and whitened SVD that measures the values' error
after the attention and o_proj (``values="attention"``), on tiny models of every supported architecture."""

from __future__ import annotations

import pytest
import torch

from lrkv_core.conversion.convert import CompressionConfig, decompose_model
from lrkv_core.model.adapters import get_adapter
from lrkv_core.statistics import STATISTICS, attention_gram, collect_attention_gram, collect_gram
from lrkv_core.statistics.attention_gram import mixed_input_gram, per_head_is_cheaper
from tests.support.models import SLIDING_WINDOW, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = {"llama": 2, "mistral": 2, "qwen2": 2, "qwen3": 2, "gemma3": 2, "phi3": 2, "opt": 4}  # KV heads


def _model(arch: str):
    extra = {"sliding_window": SLIDING_WINDOW} if arch in ("mistral", "phi3") else {}
    return tiny_model(arch, ARCHS[arch], **extra)  # OPT: MHA


@pytest.mark.parametrize("tokens", [12, 80])  # fewer and more than the hidden size (32): C, then per head
@pytest.mark.parametrize("arch", ARCHS)
def test_attention_gram_is_the_gram_of_the_attention_weighted_inputs(arch: str, tokens: int) -> None:
    """Σ_h Σ_m x̄ x̄ᵀ with x̄_{h,m} = Σ_n p_{h,mn} x_n, from the attention weights the model outputs
    (``output_attentions``, eager), over rows longer than Mistral's sliding window, short rows summed through
    C and long ones per head; the model's attention implementation is left as it was."""
    model = _model(arch)
    heads, hidden = model.config.num_attention_heads, model.config.hidden_size
    assert per_head_is_cheaper(heads, tokens, hidden) == (tokens > hidden)
    implementation = model.config._attn_implementation
    rows = torch.randint(3, model.config.vocab_size, (3, tokens), generator=torch.Generator().manual_seed(0))
    grams, n_tokens = collect_attention_gram(model, rows, batch_size=2)
    assert model.config._attn_implementation == implementation and n_tokens == 3 * tokens

    adapter = get_adapter(model.config)
    inputs = {}
    handles = [
        getattr(adapter.attention(model, i), adapter.v_name).register_forward_pre_hook(
            lambda _m, args, i=i: inputs.__setitem__(i, args[0])
        )
        for i in range(2)
    ]
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(rows, output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation(implementation)
        for h in handles:
            h.remove()
    for i in range(2):
        mixed = torch.einsum("bhmt,btd->bhmd", out.attentions[i].double(), inputs[i].double())
        expected = torch.einsum("bhmd,bhme->de", mixed, mixed)
        assert (grams[i] - expected).abs().max() <= 1e-6 * expected.abs().max()  # C is summed in float32
        # the mixing matters: it is not the plain Gram of the inputs
        plain = torch.einsum("btd,bte->de", inputs[i].double(), inputs[i].double())
        assert (grams[i] / grams[i].trace() - plain / plain.trace()).abs().max() > 1e-3


@pytest.mark.parametrize("causal", [True, False])
def test_both_orders_of_the_mixed_input_gram_give_the_float64_sum(
    causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through C = Σ_h P_hᵀ P_h and per head (query blocks of 7 positions, each mixing the inputs up to its
    last one where the weights after it are 0), the same Σ_b Σ_h (P_h X)ᵀ (P_h X) as float64 throughout, on
    causal softmax weights and on weights that are not; the cheaper order is C for short rows, per head for
    long ones (SmolLM2's 9 query heads of a 576-wide stream: through C at 256 tokens, per head at 2,048)."""
    monkeypatch.setattr(attention_gram, "QUERY_BLOCK", 7)
    gen = torch.Generator().manual_seed(0)
    B, H, T, d = 2, 3, 40, 16
    scores = torch.randn(B, H, T, T, generator=gen)
    if causal:
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    weights, x = scores.softmax(-1), torch.randn(B, T, d, generator=gen)
    mixed = torch.einsum("bhmt,btd->bhmd", weights.double(), x.double())
    want = torch.einsum("bhmd,bhme->de", mixed, mixed)
    for per_head in (False, True):
        got = mixed_input_gram(weights, x, per_head=per_head)
        assert got.dtype == torch.float64
        assert (got - want).abs().max() <= 1e-6 * want.abs().max(), per_head
    assert (mixed_input_gram(weights, x) == mixed_input_gram(weights, x, per_head=True)).all()  # T > d
    assert not per_head_is_cheaper(9, 256, 576) and per_head_is_cheaper(9, 2048, 576)
    assert not per_head_is_cheaper(32, 4096, 4096) and per_head_is_cheaper(32, 8192, 4096)  # a 7B Llama


def test_values_attention_collects_the_statistic_and_whitens_the_values_with_it() -> None:
    """``needs`` names the statistic, ``decompose_model`` collects it, keys are untouched (Palu's whitened
    SVD here) and the value factors change with it; full rank stays exact."""
    model = _model("llama")
    rows = torch.randint(3, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    configs = {
        values: CompressionConfig(
            group_size=2, decomposition={"name": "whitened", "values": values, "keys": "projection"}
        )
        for values in ("output", "attention")
    }
    assert configs["attention"].decomposition.needs == {"gram", "attention_gram"}
    assert configs["output"].decomposition.needs == {"gram"}
    needed = [s.name for s in configs["attention"].needed_statistics()]
    assert needed == ["attention_gram", "gram", "kl_response"]  # kl_response: the default allocator's
    assert isinstance(STATISTICS.create("attention_gram"), STATISTICS.get("attention_gram"))
    factors, stats = decompose_model(model, rows, configs["attention"])
    assert set(stats) == {"gram", "attention_gram"}
    output, _ = decompose_model(model, rows, configs["output"], statistics={"gram": stats["gram"]})
    for got, other in zip(factors, output, strict=True):
        torch.testing.assert_close(got.groups["k"][0].up, other.groups["k"][0].up)
        assert not torch.allclose(got.groups["v"][0].up, other.groups["v"][0].up)
        weight = get_adapter(model.config).attention(model, got.layer).v_proj.weight.double()
        assert (got.groups["v"][0].up @ got.groups["v"][0].down - weight).abs().max() <= 1e-10
        assert got.info["value_whitening"] in ("cholesky", "cholesky+damping", "eigh")
    with pytest.raises(ValueError, match=r"need calibration statistics \['attention_gram'\]"):
        decompose_model(model, None, configs["attention"], statistics={"gram": stats["gram"]})


@pytest.mark.parametrize("arch", ["llama", "gemma3", "opt"])
def test_the_forward_statistics_do_not_run_the_output_projection(arch: str) -> None:
    """The Gram and attention-Gram passes run the decoder stack only (no statistic reads the logits), and
    collect what hooks on a whole-model forward see."""
    model = _model(arch)
    rows = torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    adapter = get_adapter(model.config)
    inputs = {}
    hooks = [
        getattr(adapter.attention(model, i), adapter.k_name).register_forward_pre_hook(
            lambda _m, args, i=i: inputs.__setitem__(i, args[0].reshape(-1, args[0].shape[-1]).double())
        )
        for i in range(2)
    ]
    with torch.no_grad():
        model(rows, use_cache=False)
    for h in hooks:
        h.remove()

    def refuse(*_):
        raise AssertionError("a statistic's pass ran the output projection")

    head = model.get_output_embeddings().register_forward_pre_hook(refuse)
    try:
        grams, n_tokens = collect_gram(model, rows, batch_size=1)
        collect_attention_gram(model, rows, batch_size=2)
    finally:
        head.remove()
    assert n_tokens == 20
    for i in range(2):
        torch.testing.assert_close(grams[i], inputs[i].T @ inputs[i])
