"""What two savings in the gradient passes of a conversion are worth, on a real model and real text rows.

1. Sharing one forward pass between the refinement's two losses: a refinement step prices its moves with a
   gradient (the rows' own tokens, or the original's predictions) and a curvature (tokens sampled from the
   cut model). Alternating ``--repeats`` times: two gradient passes of their own
   (:func:`lrkv_core.statistics.gradients.kv_gradient_passes`, one per loss) against two backward passes
   through one forward (:func:`~lrkv_core.statistics.gradients.shared_gradient_passes`). Printed: the
   seconds (best of the repeats), their ratio, each one's peak RSS, and whether every visited input and
   gradient is bit for bit the same.
2. Drawing the sampled targets (the output Fisher, the KL response, the refinement's curvature) from the
   model's logits of one row: :func:`torch.multinomial` against the inverse-CDF draw
   (:func:`~lrkv_core.statistics.gradients.inverse_cdf_draw`), seconds per row (best of the repeats).
3. The loss's gradient at the last hidden states, for one loss (sampled tokens: the output Fisher's) and for
   the refinement's two (the rows' own tokens and sampled ones): autograd through the cross-entropy, the
   output projection run for each loss (the reference, here), against
   :func:`~lrkv_core.statistics.gradients.loss_gradients` (the gradient at the logits written down, one
   output projection for every loss). Seconds per row (best of the repeats) and the largest gap between
   the two gradients, relative to the largest entry; then whole passes over the rows (a single-loss pass and
   a refinement's pricing pass), the reference swapped in for ``loss_gradients`` against as they run,
   alternating: seconds (best of the repeats) and their ratio.

    OMP_NUM_THREADS=1 python benchmarks/gradient_pass_time.py --threads 1 --rows 8
"""

from __future__ import annotations

import hashlib
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from refine_time import load_rows, rows_parser  # benchmarks/, the script's own directory

from lrkv_core.statistics import gradients
from lrkv_core.statistics.gradients import (
    LOSS_CHUNK,
    _logits_of,
    inverse_cdf_draw,
    kv_gradient_passes,
    last_hidden,
    loss_gradients,
    next_token_log_probs,
    row_seeded_targets,
    shared_gradient_passes,
)
from lrkv_core.system.memory import peak_rss


def main() -> None:
    p = rows_parser(__doc__.splitlines()[0], 8, "calibration rows")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model, rows = load_rows(p, args)
    print(
        f"{Path(args.model).name}: {args.rows} rows of {args.seq_len} tokens, {args.batch_size} row(s) per "
        f"pass, {torch.get_num_threads()} thread(s)",
        flush=True,
    )

    def digest_visit(digest):
        def visit(layer, kind, x, g):
            digest.update(f"{layer}{kind}".encode())
            digest.update(x.numpy().tobytes())
            digest.update(g.numpy().tobytes())

        return visit

    def separate() -> list[str]:
        digests = [hashlib.sha256(), hashlib.sha256()]
        kv_gradient_passes(model, rows, digest_visit(digests[0]), batch_size=args.batch_size)
        kv_gradient_passes(
            model, rows, digest_visit(digests[1]), batch_size=args.batch_size, targets=row_seeded_targets(5)
        )
        return [d.hexdigest() for d in digests]

    def shared() -> list[str]:
        digests = [hashlib.sha256(), hashlib.sha256()]
        losses = [(digest_visit(digests[0]), None), (digest_visit(digests[1]), row_seeded_targets(5))]
        shared_gradient_passes(model, rows, losses, batch_size=args.batch_size)
        return [d.hexdigest() for d in digests]

    runs = {"two passes": separate, "one shared forward": shared}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    peaks: dict[str, float] = {name: 0.0 for name in runs}
    digests = {}
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            with peak_rss() as peak:
                digests[name] = run()
            seconds[name].append(time.perf_counter() - start)
            peaks[name] = max(peaks[name], peak.peak / 2**30)
            print(f"  {name}: {seconds[name][-1]:.1f} s", flush=True)
    base = min(seconds["two passes"])
    print("| gradient + curvature | seconds (best) | ratio | peak RSS, GiB |")
    print("|---|---|---|---|")
    for name in runs:
        print(f"| {name} | {min(seconds[name]):.1f} | {min(seconds[name]) / base:.3f} | {peaks[name]:.2f} |")
    print(f"identical inputs and gradients visited: {digests['two passes'] == digests['one shared forward']}")

    with torch.no_grad():  # the log-probabilities' softmax is the logits' (both draws take the softmax)
        logits = torch.cat([q for _, q in next_token_log_probs(model, last_hidden(model, rows[:1]))], 1)[0]
    draws = {
        "torch.multinomial": lambda gen: torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0],
        "inverse CDF": lambda gen: inverse_cdf_draw(logits, gen),
    }
    best = {}
    for name, draw in draws.items():
        times = []
        for _ in range(max(args.repeats, 3)):
            start = time.perf_counter()
            draw(torch.Generator().manual_seed(0))
            times.append(time.perf_counter() - start)
        best[name] = min(times)
    print(f"| drawing {logits.shape[0]} positions × {logits.shape[1]} tokens | seconds (best) | ratio |")
    print("|---|---|---|")
    for name, seconds_ in best.items():
        print(f"| {name} | {seconds_:.3f} | {seconds_ / best['torch.multinomial']:.3f} |")
    loss_step_table(model, rows, max(args.repeats, 2))
    pass_table(model, rows, args.batch_size, max(args.repeats, 2))


def autograd_loss_gradient(hidden, batch, logits_of, targets) -> torch.Tensor:
    """The reference: ∂(cross-entropy sum / scored positions)/∂hidden by autograd, chunk by chunk."""
    B, T = batch.shape
    leaf = hidden.detach().requires_grad_(True)
    draw = targets(batch) if targets is not None else None
    for start in range(0, T - 1, LOSS_CHUNK):
        stop = min(start + LOSS_CHUNK, T - 1)
        logits = logits_of(leaf[:, start:stop])
        wanted = batch[:, start + 1 : stop + 1] if draw is None else draw(logits.detach(), start)
        wanted = wanted.flatten(0, 1) if wanted.is_floating_point() else wanted.flatten()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), wanted, reduction="sum") / (
            B * (T - 1)
        )
        loss.backward()
    return leaf.grad


def loss_step_table(model, rows: torch.Tensor, repeats: int) -> None:
    """Section 3: the loss's gradient both ways, per row of ``rows``, for one loss and for two."""
    logits_of = _logits_of(model)
    with torch.no_grad():
        hiddens = [last_hidden(model, row[None]) for row in rows]
    cases = {
        "one loss (sampled tokens)": lambda: [row_seeded_targets(5)],
        "two losses (own and sampled tokens)": lambda: [None, row_seeded_targets(5)],
    }
    print("| loss's gradient | autograd, s/row | written down, s/row | ratio | largest gap |")
    print("|---|---|---|---|---|")
    for case, targets in cases.items():
        best = {"autograd": float("inf"), "written down": float("inf")}
        gap = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            want = [
                [autograd_loss_gradient(h, row[None], logits_of, t) for t in targets()]
                for h, row in zip(hiddens, rows, strict=True)
            ]
            best["autograd"] = min(best["autograd"], (time.perf_counter() - start) / len(rows))
            start = time.perf_counter()
            got = [
                loss_gradients(h, row[None], logits_of, targets())
                for h, row in zip(hiddens, rows, strict=True)
            ]
            best["written down"] = min(best["written down"], (time.perf_counter() - start) / len(rows))
            for ws, gs in zip(want, got, strict=True):
                gap = max(
                    gap, *(float((g - w).abs().max() / w.abs().max()) for g, w in zip(gs, ws, strict=True))
                )
        a, b = best["autograd"], best["written down"]
        print(f"| {case} | {a:.3f} | {b:.3f} | {b / a:.3f} | {gap:.1e} |")


@contextmanager
def autograd_losses():
    """While open, the passes take each loss's gradient by autograd (:func:`autograd_loss_gradient`)."""
    written_down = gradients.loss_gradients
    gradients.loss_gradients = lambda hidden, batch, logits_of, targets: [
        autograd_loss_gradient(hidden, batch, logits_of, t) for t in targets
    ]
    try:
        yield
    finally:
        gradients.loss_gradients = written_down


def pass_table(model, rows: torch.Tensor, batch_size: int, repeats: int) -> None:
    """Section 3's whole passes: autograd's loss gradient against the written-down one, alternating."""
    passes = {
        "one loss (sampled tokens)": lambda: kv_gradient_passes(
            model, rows, lambda *_: None, batch_size=batch_size, targets=row_seeded_targets(5)
        ),
        "pricing pass (own and sampled tokens)": lambda: shared_gradient_passes(
            model,
            rows,
            [(lambda *_: None, None), (lambda *_: None, row_seeded_targets(5))],
            batch_size=batch_size,
        ),
    }
    print("| pass over the rows | autograd's loss gradient, s | written down, s | ratio |")
    print("|---|---|---|---|")
    for name, run in passes.items():
        best = {"autograd": float("inf"), "written down": float("inf")}
        for _ in range(repeats):
            for way in best:
                start = time.perf_counter()
                if way == "autograd":
                    with autograd_losses():
                        run()
                else:
                    run()
                best[way] = min(best[way], time.perf_counter() - start)
                print(f"  {name}, {way}: {time.perf_counter() - start:.1f} s", flush=True)
        a, b = best["autograd"], best["written down"]
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.3f} |")


if __name__ == "__main__":
    main()
