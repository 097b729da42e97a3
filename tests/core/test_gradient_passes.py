"""The gradient passes behind the Fisher statistics, the KL response and the refinement: the chunked loss and
the checkpointed layers give the gradients of the model's own loss, for every supported architecture."""

from __future__ import annotations

import pytest
import torch

from lrkv_core.model.adapters import get_adapter
from lrkv_core.statistics import gradients
from lrkv_core.statistics.gradients import (
    given_probabilities,
    kv_gradient_passes,
    last_hidden,
    next_token_log_probs,
    row_seeded_targets,
    shared_gradient_passes,
)
from lrkv_core.system.memory import peak_rss, release_freed
from tests.support.fresh import run_fresh
from tests.support.models import ARCHS, UNSUPPORTED, tiny_model

SUPPORTED = [a for a in ARCHS if a not in UNSUPPORTED]


def _reference(model, rows: torch.Tensor, targets=None) -> dict[tuple[int, str], torch.Tensor]:
    """∂(mean next-token loss)/∂(each k/v projection's rows of its output), from the model's own logits in
    one piece and no checkpointing, one row at a time."""
    adapter = get_adapter(model.config)
    names = {"k": adapter.k_name, "v": adapter.v_name}
    grads: dict[tuple[int, str], list[torch.Tensor]] = {}
    for row in rows:
        outputs = {}
        handles = [
            getattr(adapter.attention(model, i), names[kind]).register_forward_hook(
                lambda _m, _a, out, key=(i, kind), into=outputs: into.__setitem__(key, out)
            )
            for i in range(model.config.num_hidden_layers)
            for kind in "kv"
        ]
        try:
            with torch.enable_grad():
                for p in model.parameters():
                    p.requires_grad_(False)
                for i in range(model.config.num_hidden_layers):
                    for kind in "kv":
                        getattr(adapter.attention(model, i), names[kind]).weight.requires_grad_(True)
                logits = model(input_ids=row[None], use_cache=False).logits[0, :-1].float()
                wanted = row[1:] if targets is None else targets(row[None])(logits[None].detach(), 0)[0]
                loss = torch.nn.functional.cross_entropy(logits, wanted)
                keys = list(outputs)
                found = torch.autograd.grad(loss, [outputs[k] for k in keys])
        finally:
            for h in handles:
                h.remove()
            for p in model.parameters():
                p.requires_grad_(True)
        for (i, kind), g in zip(keys, found, strict=True):
            grads.setdefault((i, kind), []).append(g[0, :, adapter.rows(model.config, kind)])
    return {key: torch.stack(g) for key, g in grads.items()}


def _passes(model, rows: torch.Tensor, batch_size: int, targets=None) -> dict[tuple[int, str], torch.Tensor]:
    """The gradients the passes visit, per row's own mean loss (the batch mean's times B)."""
    seen: dict[tuple[int, str], list[torch.Tensor]] = {}

    def visit(layer, kind, _x, g):
        seen.setdefault((layer, kind), []).append(g * g.shape[0])

    kv_gradient_passes(model, rows, visit, batch_size=batch_size, targets=targets)
    return {key: torch.cat(g) for key, g in seen.items()}


@pytest.mark.parametrize("arch", SUPPORTED)
@pytest.mark.parametrize("mode", ["whole", "chunked-checkpointed"])
def test_the_passes_give_the_gradients_of_the_models_own_loss(make_tiny, monkeypatch, one_thread, arch, mode):
    model = make_tiny(arch)
    rows = torch.randint(3, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    if mode != "whole":  # 5 positions per loss chunk, every layer recomputed in the backward pass
        monkeypatch.setattr(gradients, "LOSS_CHUNK", 5)
        monkeypatch.setattr(gradients, "CHECKPOINT_TOKENS", 1)
    want, got = _reference(model, rows), _passes(model, rows, batch_size=2)
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6, msg=f"{arch} {key}")
    assert all(p.requires_grad for p in model.parameters())  # the model's flags are restored


def test_sampled_and_given_targets_do_not_depend_on_chunks_or_batches(make_tiny, monkeypatch, one_thread):
    """Each row's draws come from its own generator, consumed position by position: the same draws whether
    its positions are scored at once or in chunks, alone or in a batch; given distributions are sliced."""
    model = make_tiny("llama")
    rows = torch.randint(3, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(1))
    want = _reference(model, rows, row_seeded_targets(7))
    monkeypatch.setattr(gradients, "LOSS_CHUNK", 7)
    for batch_size in (1, 4):
        got = _passes(model, rows, batch_size, row_seeded_targets(7))
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        probs = torch.softmax(torch.randn(1, 23, model.config.vocab_size), -1)
    given = _reference(model, rows[:1], given_probabilities(probs))
    got = _passes(model, rows[:1], 1, given_probabilities(probs))
    for key in given:
        torch.testing.assert_close(got[key], given[key], rtol=1e-4, atol=1e-6)


def test_sampled_tokens_follow_the_models_distribution():
    """The inverse-CDF draw: frequencies match the softmax's probabilities, a token of probability 0 is never
    drawn, and drawing a row's positions in two chunks draws what one call would."""
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    logits = probs.log().expand(40_000, -1)  # -inf where the probability is 0
    drawn = gradients.inverse_cdf_draw(logits, torch.Generator().manual_seed(0))
    freq = torch.bincount(drawn, minlength=5).double() / drawn.numel()
    assert freq[1] == 0 and freq[4] == 0
    torch.testing.assert_close(freq, probs.double(), atol=0.01, rtol=0)  # 4+ standard errors
    whole = gradients.inverse_cdf_draw(logits[:9], torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(4)
    parts = torch.cat(
        [gradients.inverse_cdf_draw(logits[:4], gen), gradients.inverse_cdf_draw(logits[4:9], gen)]
    )
    assert torch.equal(whole, parts)
    assert set(gradients.inverse_cdf_draw(torch.zeros(50, 3), gen).tolist()) <= {0, 1, 2}


@pytest.mark.parametrize("mode", ["whole", "chunked-checkpointed"])
def test_losses_sharing_a_forward_pass_visit_what_separate_passes_visit(
    make_tiny, monkeypatch, one_thread, mode
):
    """Several losses through one forward pass per micro-batch (the refinement's gradient and curvature):
    each visit sees, bit for bit, the inputs and gradients of a pass of its own, in its own order."""
    model = make_tiny("llama")
    rows = torch.randint(3, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(2))
    if mode != "whole":
        monkeypatch.setattr(gradients, "LOSS_CHUNK", 5)
        monkeypatch.setattr(gradients, "CHECKPOINT_TOKENS", 1)

    def recorder(into: list):
        return lambda layer, kind, x, g: into.append((layer, kind, x.clone(), g.clone()))

    alone: list[list] = [[], []]
    kv_gradient_passes(model, rows, recorder(alone[0]), batch_size=2)
    kv_gradient_passes(model, rows, recorder(alone[1]), batch_size=2, targets=row_seeded_targets(3))
    shared: list[list] = [[], []]
    n = shared_gradient_passes(
        model,
        rows,
        [(recorder(shared[0]), None), (recorder(shared[1]), row_seeded_targets(3))],
        batch_size=2,
    )
    assert n == (3, 2)
    for one, other in zip(alone, shared, strict=True):
        assert len(one) == len(other) == 2 * 2 * model.config.num_hidden_layers  # 2 batches × k, v per layer
        for (layer, kind, x, g), (layer2, kind2, x2, g2) in zip(one, other, strict=True):
            assert (layer, kind) == (layer2, kind2)
            assert torch.equal(x, x2) and torch.equal(g, g2)
    assert not torch.equal(alone[0][0][3], alone[1][0][3])  # the two losses' gradients differ
    with pytest.raises(ValueError, match="at least one"):
        shared_gradient_passes(model, rows, [])


def test_loss_gradients_are_autograds_cross_entropy_with_one_output_projection_per_chunk(
    make_tiny, monkeypatch, one_thread
):
    """The loss's gradient written down at the logits is what autograd through the cross-entropy gives, for
    the rows' own tokens, drawn tokens and given distributions at once, and the output projection runs once
    per chunk for all of them."""
    model = make_tiny("gemma3", final_logit_softcapping=3.0)  # its logits soft-capped
    rows = torch.randint(3, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = last_hidden(model, rows)
        probs = torch.softmax(torch.randn(2, 12, model.config.vocab_size), -1)
    logits_of = gradients._logits_of(model)

    def targets():  # afresh for each use: a row-seeded draw counts the rows it has seen
        return [None, row_seeded_targets(2), given_probabilities(probs)]

    want = []
    for t in targets():
        leaf = hidden.detach().requires_grad_(True)
        logits = logits_of(leaf[:, :-1])
        wanted = rows[:, 1:] if t is None else t(rows)(logits.detach(), 0)
        wanted = wanted.flatten(0, 1) if wanted.is_floating_point() else wanted.flatten()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), wanted, reduction="sum") / 24
        (grad,) = torch.autograd.grad(loss, leaf)
        want.append(grad)
    monkeypatch.setattr(gradients, "LOSS_CHUNK", 5)
    calls = []
    handle = model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    try:
        got = gradients.loss_gradients(hidden, rows, logits_of, targets())
    finally:
        handle.remove()
    assert len(calls) == 3  # 12 scored positions in chunks of 5, once for the three losses
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        assert not g[:, -1].any()  # the last position scores nothing
    assert not torch.equal(got[0], got[1])


@pytest.mark.parametrize("arch", SUPPORTED)
def test_chunked_log_probabilities_are_the_models_own(make_tiny, monkeypatch, one_thread, arch):
    """The next-token log-probabilities taken a chunk of positions at a time, from the decoder stack's
    output, are the model's own (its output projection and any final soft-capping), position by position."""
    model = make_tiny(arch)
    rows = torch.randint(3, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(gradients, "LOSS_CHUNK", 6)
    with torch.no_grad():
        want = torch.log_softmax(model(input_ids=rows, use_cache=False).logits[:, :-1].float(), dim=-1)
        chunks = list(next_token_log_probs(model, last_hidden(model, rows)))
    assert [start for start, _ in chunks] == [0, 6, 12, 18]
    torch.testing.assert_close(torch.cat([q for _, q in chunks], dim=1), want, rtol=1e-5, atol=1e-5)


def test_measuring_targets_are_the_original_models_probabilities_and_add_up_the_kl(
    make_tiny, monkeypatch, one_thread
):
    """The refinement's KL targets, computed from another model's last hidden states chunk by chunk, give the
    gradients of the cross-entropy against that model's whole-row probabilities, and add up the KL from
    those to this model's predictions."""
    from lrkv_core.conversion.refine import measuring_targets

    model, other = make_tiny("llama"), make_tiny("llama")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    rows = torch.randint(3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        log_p = torch.log_softmax(other(input_ids=rows, use_cache=False).logits[:, :-1].float(), dim=-1)
        log_q = torch.log_softmax(model(input_ids=rows, use_cache=False).logits[:, :-1].float(), dim=-1)
        hidden = last_hidden(other, rows)
    monkeypatch.setattr(gradients, "LOSS_CHUNK", 7)
    want = _passes(model, rows, 1, given_probabilities(log_p.exp()))
    total = [0.0]
    got = _passes(model, rows, 1, measuring_targets(total, next_token_log_probs(other, hidden)))
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6)
    kl = float((log_p.exp() * (log_p - log_q)).sum())
    assert kl > 0 and total[0] == pytest.approx(kl, rel=1e-4)


def _long_row_peaks() -> None:
    """A wide, deep model over one row of 2,048 tokens: checkpointed layers and a chunked loss keep the pass
    well under what keeping every layer's activations and the whole row's logits takes."""
    torch.set_num_threads(1)
    model = tiny_model("llama", num_hidden_layers=8, hidden_size=256, intermediate_size=1024, head_dim=64,
                       vocab_size=8192, max_position_embeddings=4096)  # fmt: skip
    rows = torch.randint(3, 8192, (1, 2048), generator=torch.Generator().manual_seed(0))
    peaks = {}
    bounded = (gradients.LOSS_CHUNK, gradients.CHECKPOINT_TOKENS)
    for name, (chunk, tokens) in (("kept", (10**9, 10**9)), ("bounded", bounded)):
        gradients.LOSS_CHUNK, gradients.CHECKPOINT_TOKENS = chunk, tokens
        release_freed()
        with peak_rss() as watch:
            kv_gradient_passes(model, rows, lambda *_: None, batch_size=1)
        peaks[name] = watch.peak
    logits = 2048 * 8192 * 4  # one copy of the row's full-vocabulary logits, float32
    assert peaks["kept"] - peaks["bounded"] > 2 * logits, peaks


def test_a_long_row_holds_far_less_than_every_layers_activations():
    # in a fresh process: memory an earlier test left with the allocator would absorb the pass's
    run_fresh("tests.core.test_gradient_passes:_long_row_peaks")
