"""How GEAR's streaming rule treats old tokens during a long decode, on synthetic latents.

    python benchmarks/gear_cache.py --bits 2,4 --prompt 64 --steps 200 --buffer 20

Heavy-tailed latents (Student-t, 3 degrees of freedom, decaying scales; two key groups of rank 8, one value
group of 16, batch 2) are put through a ``gear`` store: a ``--prompt``-token prefill, then ``--steps`` tokens
one at a time. For each storage it prints the relative error ‖X̂ − X‖ / ‖X‖ of the prompt's latents right
after the prefill (a store with ``buffer: 0``) and after the decode. ``mode: whole`` (the paper's Algorithm 1)
compresses the reconstruction of the whole cache again at every buffer fill, so the prompt's error grows
with the number of fills; ``mode: chunked`` never touches a compressed chunk again. Seeded; CPU.
"""

from __future__ import annotations

import argparse

import torch

from lrkv_core.cache import CACHE_STORAGES

RANKS_K, RANKS_V = (8, 8), (16,)
STORAGES = {
    "paper (share, power, whole)": {},
    "share, power, chunked": {"mode": "chunked"},
    "count 1, svd, chunked": {"outlier_share": 0.0, "outliers": 1, "solver": "svd", "mode": "chunked"},
}


def latents(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """h_k (2, tokens, 16), h_v (2, tokens, 16): Student-t latents, key scales falling along the rank."""
    torch.manual_seed(seed)
    t = torch.distributions.StudentT(3.0)
    return t.sample((2, tokens, 16)) * torch.linspace(2.0, 0.3, 16), t.sample((2, tokens, 16))


def prompt_error(storage: dict, h_k: torch.Tensor, h_v: torch.Tensor, prompt: int, steps: list[int]) -> float:
    """Relative error of the first ``prompt`` tokens' latents after appends of ``steps`` tokens."""
    store = CACHE_STORAGES.create(storage).create_store(RANKS_K, RANKS_V)
    start = 0
    for n in steps:
        store.append(h_k[:, start : start + n], h_v[:, start : start + n])
        start += n
    view = store.view()
    got = torch.cat([*view.keys, *view.values], dim=-1)[:, :prompt]
    truth = torch.cat([h_k, h_v], dim=-1)[:, :prompt]
    return ((got - truth).norm() / truth.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", default="2,4", help="comma-separated bits")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--buffer", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    h_k, h_v = latents(args.prompt + args.steps)
    print("| bits | storage | prompt error after prefill | after the decode |")
    print("|---|---|---|---|")
    for bits in (int(b) for b in args.bits.split(",")):
        for label, options in STORAGES.items():
            storage = {"name": "gear", "bits": bits, "buffer": args.buffer} | options
            before = prompt_error(storage | {"buffer": 0}, h_k, h_v, args.prompt, [args.prompt])
            after = prompt_error(storage, h_k, h_v, args.prompt, [args.prompt] + [1] * args.steps)
            print(f"| {bits} | {label} | {before:.4f} | {after:.4f} |")


if __name__ == "__main__":
    main()
