"""How much a rotation before per-token quantization loses of a compressed model's latents, by rotation kind.

    S=../shared; W=$S/data/wikitext-2/valid.txt
    python benchmarks/rotation_error.py --model-dir smol-full-rank --dataset "text:$W[80%:90%]" \\
        --widths 56,57,135 --bits 3,2

The model (an lrkv conversion without a fused rotation, so its latents come in spectral order) reads one
``--tokens``-token window from the start of ``--dataset``; forward hooks on every ``--every``-th layer's
``k_down`` and ``v_down`` take its key and value latents. For each width w of ``--widths``, the first w
latents of every token of the layer's first group are rotated by an orthogonal R (w × w), quantized per token
at each of ``--bits`` (:func:`lrkv_core.quant.fake_quantize`, one block of w), rotated back, and compared:
the relative error ``‖ĥ − h‖ / ‖h‖``, averaged over the layers, keys and values apart. Rotations:

- ``none``: no rotation;
- ``lrkv``: :func:`lrkv_core.quant.rotation.rotation_matrix` under ``auto`` (Hadamard where one of order w
  is built, else random; first row constant either way);
- ``haar``: a Haar-random orthogonal matrix (QR of a seeded Gaussian matrix);
- ``alternating``: lrkv's matrix with the sign of every other column flipped (a first row of alternating
  signs, as a Hadamard matrix may come from its construction).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from lrkv_core.data.datasets import token_sequences
from lrkv_core.model.loading import load_model, load_tokenizer
from lrkv_core.quant import fake_quantize
from lrkv_core.quant.rotation import rotation_matrix


def rotations(width: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The rotations compared at one width (float64)."""
    ours, _ = rotation_matrix(width, "auto", seed)
    gen = torch.Generator().manual_seed(seed)
    haar, r = torch.linalg.qr(torch.randn(width, width, generator=gen, dtype=torch.float64))
    haar = haar * torch.sign(torch.diagonal(r))
    signs = torch.where(torch.arange(width) % 2 == 0, 1.0, -1.0).double()
    return {
        "none": torch.eye(width, dtype=torch.float64),
        "lrkv": ours,
        "haar": haar,
        "alternating": ours * signs,
    }


def relative_error(h: torch.Tensor, rotation: torch.Tensor, bits: int) -> float:
    """``‖ĥ − h‖ / ‖h‖`` for rows h (N, w) rotated, quantized per row at ``bits`` and rotated back."""
    h, r = h.double(), rotation
    back = fake_quantize(h @ r, (h.shape[-1],), bits) @ r.T
    return ((back - h).norm() / h.norm()).item()


def capture(model: torch.nn.Module, ids: torch.Tensor, every: int) -> dict[str, list[torch.Tensor]]:
    """Key and value latents (T, R) of every ``every``-th layer, from hooks on ``k_down`` / ``v_down``."""
    got: dict[str, list[torch.Tensor]] = {"keys": [], "values": []}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if i % every or not hasattr(attn, "k_down"):
            continue
        for kind, module in (("keys", attn.k_down), ("values", attn.v_down)):
            hooks.append(
                module.register_forward_hook(lambda m, a, out, k=kind: got[k].append(out[0].detach()))
            )
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    if not got["keys"]:
        raise SystemExit("no k_down/v_down in this model: give an lrkv conversion (--model-dir)")
    return got


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="an lrkv conversion with rotation none")
    ap.add_argument("--dataset", required=True, help="text:PATH[slice] or any dataset reference lrkv reads")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--widths", default="56,57,135", help="comma-separated latent widths")
    ap.add_argument("--bits", default="3,2", help="comma-separated bit widths (2, 3, 4 or 8)")
    ap.add_argument("--every", type=int, default=3, help="measure every N-th layer")
    args = ap.parse_args(argv)
    model, _ = load_model(args.model_dir)
    if (getattr(model.config, "lrkv", None) or {}).get("rotation", "none") != "none":
        raise SystemExit("this conversion carries a fused rotation: its latents are not in spectral order")
    seq = torch.cat([s.reshape(-1) for s in token_sequences(args.dataset, load_tokenizer(args.model_dir))])
    if seq.numel() < args.tokens:
        raise SystemExit(f"{args.dataset} has {seq.numel()} tokens, fewer than --tokens {args.tokens}")
    latents = capture(model, seq[None, : args.tokens], args.every)
    widths = [int(w) for w in args.widths.split(",")]
    bits = [int(b) for b in args.bits.split(",")]
    print(f"{args.model_dir}: {len(latents['keys'])} layers, {args.tokens} tokens of {args.dataset}")
    print(
        "| width | rotation | "
        + " | ".join(f"{k}, {b} bits" for b in bits for k in ("keys", "values"))
        + " |"
    )
    print("|---|---|" + "---|" * (2 * len(bits)))
    for w in widths:
        firsts = {kind: [h[:, :w] for h in latents[kind] if h.shape[-1] >= w] for kind in latents}
        for kind, layers in firsts.items():
            if not layers:
                raise SystemExit(f"width {w} exceeds the {kind}' latents")
        errors: dict[str, list[float]] = defaultdict(list)
        for name, r in rotations(w).items():
            for b in bits:
                for layers in firsts.values():
                    errors[name].append(sum(relative_error(h, r, b) for h in layers) / len(layers))
        for name, row in errors.items():
            print(f"| {w} | {name} | " + " | ".join(f"{e:.3f}" for e in row) + " |")


if __name__ == "__main__":
    main()
