"""Low-rank keys before vs after RoPE: perplexity and reconstruction error at long windows.

At the same rank r, how much worse is projecting the keys *after* RoPE (what a cache of rotated-key
latents, read by absorbed queries, needs) than *before* it (what lrkv's latents are today), and which bases
of rotated keys keep their quality at positions past the calibration windows?

Per layer, the KV heads form one group (SmolLM2-135M: 3 heads of 64, 192 dims; a token's key is the heads'
keys concatenated in head order). Calibration (first half of the tokenized text) collects, per layer, the
float64 Grams of

* the pre-RoPE keys (k_proj output, before ``apply_rotary_pos_emb``), the post-RoPE keys, and the post-RoPE
  queries (each KV head's block summing its query heads' ``q qᵀ``), from ``--calib-windows`` consecutive
  windows of ``--calib-len`` tokens;
* the post-RoPE keys of the *same* tokens cut into ``--short-len``-token windows (positions < short-len).

Evaluation (second half, disjoint) measures perplexity on ``--eval-windows`` non-overlapping windows of
``--eval-len`` tokens with keys replaced per layer by a rank-r map (values and queries untouched):

* ``original``;
* ``pre-rope``: k <- U U^T k on the pre-RoPE keys (U: top-r eigenvectors of their Gram), then RoPE;
* ``post-rope``: k_rot <- U U^T k_rot after RoPE (U from the long-window post-RoPE Gram);
* ``post-rope@short``: the same with U from the short-window post-RoPE Gram;
* ``post-q``: k_rot <- B A k_rot, the rank-r map minimising the scores' error weighted by the queries
  (:func:`oblique`);
* ``equiv`` / ``equiv-q``: a map that commutes with RoPE (:func:`equivariant`: per rotation frequency, one
  complex map across the group's heads), unweighted or weighted by the queries; applied before RoPE, which
  is the same as after.

It also reports, per basis, the mean over layers of the relative key reconstruction error
sum ||k - U U^T k||^2 / sum ||k||^2 (energy-weighted within a layer) on the *clean* evaluation keys (those of
the original model's forward; pre- or post-RoPE as appropriate), split by position within the window
(< 256, >= 1024, and >= 2048 for longer windows). ``mean_tok_ratio`` in the JSON is the per-token ratio's
mean.

Keys are intercepted by patching ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb`` (looked up
at call time by ``LlamaAttention.forward``) and wrapping each layer's ``self_attn.forward`` to record
the layer index. A check first runs every config with r = head-group width (U U^T ~ identity) and
compares the loss with the original's.

Optionally (``--long-windows`` > 0) repeats every config at ``--long-ranks`` on ``--long-windows`` windows
of ``--long-len`` tokens from the start of the evaluation half.

One JSON line per result on stdout (and in ``--jsonl``, rewritten), then a markdown table.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/rotated_keys.py --threads 2 \\
        --model ~/.cache/lrkv-assets/smollm2-135m --text ../shared/data/wikitext-2/valid.txt
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F
import transformers.models.llama.modeling_llama as llama_mod
from transformers import AutoModelForCausalLM, AutoTokenizer

# ----------------------------------------------------------------------------------------------------------
# interception state

STATE: dict = {
    "layer": None,  # current layer index (set by the self_attn.forward wrapper)
    "mode": None,  # None | "pre" | "post"
    "proj": None,  # per-layer (D, D) float32 projector U U^T for mode "pre"/"post"
    "calib": None,  # dict: {"pre": [G...], "post": [G...]} float64 Grams to accumulate into, or None
    "stats": None,  # list of (name, kind, per-layer U float64) bases to score on the clean keys, or None
    "stat_acc": None,  # accumulator for "stats"
    "calls": 0,
}
_ORIG_ROPE = llama_mod.apply_rotary_pos_emb


def _flat(k: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, hd) -> (batch, seq, heads*hd), heads concatenated in order."""
    b, h, s, d = k.shape
    return k.permute(0, 2, 1, 3).reshape(b, s, h * d)


def _unflat(x: torch.Tensor, h: int) -> torch.Tensor:
    b, s, hd = x.shape
    return x.reshape(b, s, h, hd // h).permute(0, 2, 1, 3).contiguous()


def _project(k: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    h = k.shape[1]
    return _unflat(_flat(k) @ P.to(k.dtype), h)


BUCKETS = {"lt256": (0, 256), "256to1024": (256, 1024), "ge1024": (1024, 10**9), "ge2048": (2048, 10**9)}


def _score(kind: str, k: torch.Tensor, layer: int) -> None:
    """Accumulate reconstruction error of the clean keys ``k`` (pre or post) for every basis of that kind."""
    x = _flat(k).double()[0]  # (seq, D); batch 1
    pos = torch.arange(x.shape[0])
    norm = (x * x).sum(-1)
    for name, bkind, Us in STATE["stats"]:
        if bkind != kind:
            continue
        U = Us[layer]
        res = (norm - ((x @ U) ** 2).sum(-1)).clamp_min(0)
        for bname, (lo, hi) in BUCKETS.items():
            m = (pos >= lo) & (pos < hi)
            if not m.any():
                continue
            acc = STATE["stat_acc"].setdefault((name, layer, bname), [0.0, 0.0, 0.0, 0])
            acc[0] += res[m].sum().item()
            acc[1] += norm[m].sum().item()
            acc[2] += (res[m] / norm[m]).sum().item()
            acc[3] += int(m.sum())


def patched_rope(q, k, cos, sin, *args, **kwargs):
    STATE["calls"] += 1
    layer = STATE["layer"]
    k_pre = k
    if STATE["mode"] == "pre":
        k = _project(k, STATE["proj"][layer])
    q_out, k_out = _ORIG_ROPE(q, k, cos, sin, *args, **kwargs)
    if STATE["calib"] is not None:
        for kind, kk in (("pre", k_pre), ("post", k_out)):
            x = _flat(kk).double().reshape(-1, _flat(kk).shape[-1])
            STATE["calib"][kind][layer] += x.T @ x
        if "q" in STATE["calib"]:  # post-RoPE queries, each KV head's block summing its query heads
            kvh, hd = k.shape[1], k.shape[-1]
            n_rep = q_out.shape[1] // kvh
            for j in range(kvh):
                qs = q_out[:, j * n_rep : (j + 1) * n_rep].double().reshape(-1, hd)
                STATE["calib"]["q"][layer][j * hd : (j + 1) * hd, j * hd : (j + 1) * hd] += qs.T @ qs
    if STATE["stats"] is not None:
        _score("pre", k_pre, layer)
        _score("post", k_out, layer)
    if STATE["mode"] == "post":
        k_out = _project(k_out, STATE["proj"][layer])
    return q_out, k_out


def install(model) -> None:
    llama_mod.apply_rotary_pos_emb = patched_rope
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        orig = attn.forward

        def fwd(*a, _i=i, _orig=orig, **kw):
            STATE["layer"] = _i
            try:
                return _orig(*a, **kw)
            finally:
                STATE["layer"] = None

        attn.forward = fwd


# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def window_nll(model, ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL over one window (1-D ids) and the number of predicted tokens."""
    out = model(input_ids=ids[None], use_cache=False)
    logits = out.logits[0, :-1].float()
    nll = F.cross_entropy(logits, ids[1:], reduction="sum").item()
    return nll, ids.numel() - 1


def windows(tokens: torch.Tensor, start: int, n: int, length: int) -> list[torch.Tensor]:
    ws = [tokens[start + i * length : start + (i + 1) * length] for i in range(n)]
    if any(w.numel() < length for w in ws):
        raise SystemExit(f"not enough tokens for {n} windows of {length} from {start}")
    return ws


def evaluate(model, wins, mode=None, proj=None) -> dict:
    STATE["mode"], STATE["proj"] = mode, proj
    tot, cnt, per = 0.0, 0, []
    t0 = time.time()
    try:
        for w in wins:
            nll, n = window_nll(model, w)
            tot += nll
            cnt += n
            per.append(nll / n)
    finally:
        STATE["mode"], STATE["proj"] = None, None
    return {
        "nll": tot / cnt,
        "ppl": math.exp(tot / cnt),
        "tokens": cnt,
        "window_nll": per,
        "secs": time.time() - t0,
    }


def _damped_roots(S: torch.Tensor, damp: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """S^½ and S^-½ of a (Hermitian) Gram scaled to mean eigenvalue 1 plus ``damp`` of the identity."""
    S = S / (S.diagonal().real.mean()) + damp * torch.eye(S.shape[0], dtype=S.dtype)
    ev, V = torch.linalg.eigh(S)
    ev = ev.clamp_min(1e-12)
    return (V * ev.sqrt()) @ V.mH, (V / ev.sqrt()) @ V.mH


def oblique(Sq: torch.Tensor, Sk: torch.Tensor, r: int) -> torch.Tensor:
    """B A (D, D) of rank r minimising the score error ||Sq^½ (I − B A) Sk^½||_F (keys' Gram Sk, queries'
    Gram Sq): the keys become ``B A k``, i.e. the cache holds ``A k`` and each query absorbs ``B``."""
    q_half, q_inv = _damped_roots(Sq)
    k_half, k_inv = _damped_roots(Sk)
    U, sv, Vh = torch.linalg.svd(q_half @ k_half)
    return (q_inv @ U[:, :r]) @ ((sv[:r, None] * Vh[:r]) @ k_inv)


def equivariant(Gk: torch.Tensor, Gq: torch.Tensor | None, r: int, kvh: int, hd: int) -> torch.Tensor:
    """A rank-r map (D, D) that commutes with RoPE: per rotation frequency j, a complex map across the
    group's heads of the pairs z = (k_j + i·k_{j+hd/2}) (RoPE multiplies each by the same e^{iθ}), the
    frequencies' components kept by their (score-weighted) energy until r real dims (r/2 complex). Without
    queries (``Gq`` None) the projection on each frequency's top eigenvectors; with them, the oblique map
    weighing each head's error by its queries' energy at that frequency."""
    half = hd // 2
    maps, cands = {}, []
    for j in range(half):
        ia = torch.tensor([h * hd + j for h in range(kvh)])
        ib = ia + half
        Ck = (Gk[ia][:, ia] + Gk[ib][:, ib]) + 1j * (Gk[ib][:, ia] - Gk[ia][:, ib])
        Ck = (Ck + Ck.mH) / 2
        if Gq is None:
            ev, V = torch.linalg.eigh(Ck)
            maps[j] = (ia, ib, lambda keep, V=V: V[:, keep] @ V[:, keep].mH)
            cands += [(float(ev[m]), j, m) for m in range(kvh)]
        else:
            w = (Gq[ia, ia] + Gq[ib, ib]).to(torch.complex128)  # each head's query energy at frequency j
            Sq = torch.diag(w)
            q_half, q_inv = _damped_roots(Sq)
            k_half, k_inv = _damped_roots(Ck)
            U, sv, Vh = torch.linalg.svd(q_half @ k_half)
            maps[j] = (
                ia, ib,
                lambda keep, U=U, sv=sv, Vh=Vh, q_inv=q_inv, k_inv=k_inv: (q_inv @ U[:, keep])
                @ ((sv[keep, None].to(Vh.dtype) * Vh[keep]) @ k_inv),
            )  # fmt: skip
            scale = (Sq.diagonal().real.mean() * Ck.diagonal().real.mean()).item()
            cands += [(float(sv[m]) ** 2 * scale, j, m) for m in range(kvh)]
    cands.sort(reverse=True)
    keep: dict[int, list[int]] = {}
    for _, j, m in cands[: r // 2]:
        keep.setdefault(j, []).append(m)
    P = torch.zeros(Gk.shape, dtype=torch.float64)
    for j, ms in keep.items():
        ia, ib, make = maps[j]
        M = make(torch.tensor(ms))
        P[ia[:, None], ia[None, :]], P[ia[:, None], ib[None, :]] = M.real, -M.imag
        P[ib[:, None], ia[None, :]], P[ib[:, None], ib[None, :]] = M.imag, M.real
    return P


def top_basis(G: torch.Tensor, r: int) -> torch.Tensor:
    evals, evecs = torch.linalg.eigh(G)  # ascending
    return evecs[:, torch.argsort(evals, descending=True)[:r]].contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/lrkv-assets/smollm2-135m"))
    shared = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared")
    ap.add_argument("--text", default=os.path.join(shared, "data", "wikitext-2", "valid.txt"))
    ap.add_argument("--ranks", type=int, nargs="+", default=[96, 144])
    ap.add_argument("--calib-windows", type=int, default=8)
    ap.add_argument("--calib-len", type=int, default=2048)
    ap.add_argument("--short-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--eval-len", type=int, default=2048)
    ap.add_argument(
        "--check-len", type=int, default=512, help="window length of the identity check (1 window)"
    )
    ap.add_argument("--long-windows", type=int, default=4, help="0 to skip the long-window evaluation")
    ap.add_argument("--long-len", type=int, default=4096)
    ap.add_argument("--long-ranks", type=int, nargs="+", default=[96])
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--jsonl", default="/tmp/rotated_keys.jsonl")
    args = ap.parse_args()
    if not os.path.isfile(args.text):
        ap.error(f"--text {args.text}: no such file")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        ap.error(
            f"--model {args.model}: not a model directory (no config.json; see ../shared/models/*/prepare.py)"
        )

    torch.set_num_threads(args.threads)
    t_start = time.time()
    open(args.jsonl, "w").close()

    def emit(rec: dict) -> None:
        line = json.dumps(rec)
        print(line, flush=True)
        with open(args.jsonl, "a") as f:
            f.write(line + "\n")

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation=args.attn
    )
    model.eval()
    install(model)
    cfg = model.config
    n_layers, kvh, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    D = kvh * hd

    with open(args.text) as f:
        text = f.read()
    tokens = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    half = tokens.numel() // 2
    calib_tokens, eval_tokens = tokens[:half], tokens[half:]
    emit(
        {
            "kind": "setup",
            "tokens": tokens.numel(),
            "calib_half": half,
            "eval_half": eval_tokens.numel(),
            "layers": n_layers,
            "kv_heads": kvh,
            "head_dim": hd,
            "group_dim": D,
            "attn": args.attn,
        }
    )

    # ---- calibration ------------------------------------------------------------------------------------
    def calibrate(length: int, n: int, queries: bool = False) -> dict:
        kinds = ("pre", "post", "q") if queries else ("pre", "post")
        STATE["calib"] = {k: [torch.zeros(D, D, dtype=torch.float64) for _ in range(n_layers)] for k in kinds}
        t0 = time.time()
        try:
            with torch.no_grad():
                for w in windows(calib_tokens, 0, n, length):
                    model(input_ids=w[None], use_cache=False)
        finally:
            grams, STATE["calib"] = STATE["calib"], None
        emit(
            {
                "kind": "calibration",
                "len": length,
                "windows": n,
                "tokens": n * length,
                "secs": time.time() - t0,
            }
        )
        return grams

    g_long = calibrate(args.calib_len, args.calib_windows, queries=True)
    n_short = args.calib_windows * args.calib_len // args.short_len
    g_short = calibrate(args.short_len, n_short)
    grams = {"pre": g_long["pre"], "post": g_long["post"], "post@short": g_short["post"]}
    kind_of = {"pre": "pre", "post": "post", "post@short": "post"}
    mode_of = {"pre": "pre", "post": "post", "post@short": "post"}
    label = {
        "pre": "pre-rope",
        "post": "post-rope",
        "post@short": f"post-rope (calibrated at {args.short_len})",
    }

    # spectrum summary: energy fraction captured at each rank by each Gram (on its own calibration keys)
    for g in grams:
        for r in args.ranks:
            fr = []
            for G in grams[g]:
                ev = torch.linalg.eigvalsh(G).flip(0)
                fr.append((ev[:r].sum() / ev.sum()).item())
            emit({"kind": "calib_energy", "basis": g, "r": r, "mean_captured": sum(fr) / len(fr)})

    bases = {
        (g, r): [top_basis(G, r) for G in grams[g]]
        for g in grams
        for r in sorted(set(args.ranks + args.long_ranks + [D]))
    }
    projs = {key: [(U @ U.T).float() for U in Us] for key, Us in bases.items()}
    # the maps below are stored transposed, as the projections above (a key row x becomes x @ P)
    extra = {
        "post-q": (
            "post", "post-rope, query-weighted",
            lambda L, r: oblique(g_long["q"][L], g_long["post"][L], r),
        ),
        "equiv": ("pre", "RoPE-equivariant", lambda L, r: equivariant(g_long["pre"][L], None, r, kvh, hd)),
        "equiv-q": (
            "pre", "RoPE-equivariant, query-weighted",
            lambda L, r: equivariant(g_long["pre"][L], g_long["q"][L], r, kvh, hd),
        ),
    }  # fmt: skip
    for name, (mode, text_label, make) in extra.items():
        mode_of[name], label[name] = mode, text_label
        for r in sorted(set(args.ranks + args.long_ranks + [D])):
            projs[(name, r)] = [make(L, r).T.float() for L in range(n_layers)]
    every = [*grams, *extra]

    # ---- identity check ---------------------------------------------------------------------------------
    chk = windows(eval_tokens, 0, 1, args.check_len)
    STATE["calls"] = 0
    base = evaluate(model, chk)
    assert STATE["calls"] == n_layers, f"patched rope called {STATE['calls']} times, expected {n_layers}"
    for g in every:
        res = evaluate(model, chk, mode_of[g], projs[(g, D)])
        emit(
            {
                "kind": "identity_check",
                "config": g,
                "r": D,
                "len": args.check_len,
                "nll_original": base["nll"],
                "nll": res["nll"],
                "abs_diff": abs(res["nll"] - base["nll"]),
                "ok": abs(res["nll"] - base["nll"]) < 1e-4,
            }
        )
    # a rank-halving must actually change the loss (the patch is live)
    res = evaluate(model, chk, "post", projs[("post", args.ranks[0])])
    emit(
        {
            "kind": "patch_live_check",
            "config": "post",
            "r": args.ranks[0],
            "nll_original": base["nll"],
            "nll": res["nll"],
        }
    )

    # ---- evaluation -------------------------------------------------------------------------------------
    results = []

    def run_eval(length: int, n: int, ranks: list[int]) -> None:
        wins = windows(eval_tokens, 0, n, length)
        # original + reconstruction errors of every basis on the clean keys
        STATE["stats"] = [(f"{g}|{r}", kind_of[g], bases[(g, r)]) for g in grams for r in ranks]
        STATE["stat_acc"] = {}
        try:
            orig = evaluate(model, wins)
        finally:
            acc, STATE["stats"], STATE["stat_acc"] = STATE["stat_acc"], None, None
        rec = {"kind": "ppl", "len": length, "windows": n, "config": "original", "r": None, **orig}
        emit(rec)
        results.append(rec)

        def recon(g, r):
            out = {}
            for bname in BUCKETS:
                per = [acc[(f"{g}|{r}", L, bname)] for L in range(n_layers) if (f"{g}|{r}", L, bname) in acc]
                if len(per) != n_layers:
                    continue
                out[bname] = sum(a[0] / a[1] for a in per) / n_layers
                out[bname + "_mean_tok_ratio"] = sum(a[2] / a[3] for a in per) / n_layers
            return out

        for r in ranks:
            for g in every:
                res = evaluate(model, wins, mode_of[g], projs[(g, r)])
                rec = {
                    "kind": "ppl",
                    "len": length,
                    "windows": n,
                    "config": label[g],
                    "basis": g,
                    "r": r,
                    **res,
                    "delta_nll": res["nll"] - orig["nll"],
                    "recon_err": recon(g, r) if g in grams else {},
                }
                emit(rec)
                results.append(rec)

    run_eval(args.eval_len, args.eval_windows, args.ranks)
    if args.long_windows > 0:
        run_eval(args.long_len, args.long_windows, args.long_ranks)

    wall = time.time() - t_start
    emit({"kind": "done", "wall_s": wall})

    # ---- table ------------------------------------------------------------------------------------------
    print()
    print("| window | config | r | PPL | ΔNLL | key err pos<256 | key err pos≥1024 | key err pos≥2048 |")
    print("|---|---|---|---|---|---|---|---|")
    for rec in results:
        e = rec.get("recon_err", {})

        def f(k, e=e):
            return f"{e[k]:.4f}" if k in e else "–"

        d = f"{rec['delta_nll']:+.4f}" if "delta_nll" in rec else "–"
        print(
            f"| {rec['windows']}×{rec['len']} | {rec['config']} | {rec['r'] or '–'} | "
            f"{rec['ppl']:.3f} | {d} | "
            f"{f('lt256')} | {f('ge1024')} | {f('ge2048')} |"
        )
    print(f"\nwall time {wall:.0f} s")


if __name__ == "__main__":
    main()
