"""The bar across runs: a setting's rise against half of Palu's, window by window, with intervals.

Reads the JSON lines of ``benchmarks/allocation.py`` runs (each row keeps its per-window NLLs). For every
row of ``--setting`` it finds, on the same model, calibration text and draw, held-out text and ratio, the
reference: ``fisher (Palu's rule)`` on Palu's decomposition (values and keys taken at their projections,
``--reference-decomposition``), and ``uniform`` on the row's own decomposition. On the first ``--first``
windows (the bar's protocol) and on all of them it prints the rise, the bar (half of the reference's
rise), whether the bar is met, and 95 % paired bootstrap intervals (windows resampled) of
``rise − ½ · rise(Palu)`` and ``rise − rise(uniform)``: an interval that holds zero is a difference the
held-out text cannot tell from a resampling of its windows.

    python benchmarks/against_palu.py docs/decomposition/shakespeare-keys-fisher-kl.jsonl \\
        docs/decomposition/shakespeare-palu-kl.jsonl --out docs/decomposition/shakespeare-against-palu.md
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from allocation import paired_interval, rise  # benchmarks/, the script's own directory

PALU = {"name": "whitened", "values": "projection", "keys": "projection"}
DEFAULT = "kl + 3 refine steps on 128 rows, nll"


def _matches(decomposition: Any, wanted: dict) -> bool:
    return isinstance(decomposition, dict) and all(decomposition.get(k) == v for k, v in wanted.items())


def _cell(row: dict) -> tuple:
    return row["model"], row["calibration"], row["seed"], row["eval"], row["ratio"]


def _same_windows(a: list[float], b: list[float]) -> bool:
    """The original's per-window NLLs agree: the same windows, measured on any CPU (float32 sums in another
    order move them by about 1e-7 nats)."""
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 for x, y in zip(a, b))


def compare(rows: list[dict], setting: str, reference: dict, first: int) -> list[dict]:
    """One result per row of ``setting`` that has both references in ``rows``."""
    palu: dict[tuple, dict] = {}
    uniform: dict[tuple, dict] = {}
    for r in rows:
        if r["setting"] == "fisher (Palu's rule)" and _matches(r["decomposition"], reference):
            palu[_cell(r)] = r
        if r["setting"] == "uniform":
            uniform[_cell(r) + (json.dumps(r["decomposition"], sort_keys=True),)] = r
    results = []
    for r in rows:
        if r["setting"] != setting:
            continue
        ref = palu.get(_cell(r))
        uni = uniform.get(_cell(r) + (json.dumps(r["decomposition"], sort_keys=True),))
        if ref is None or uni is None:
            print(f"skipped {_cell(r)}: no {'Palu reference' if ref is None else 'uniform'} row")
            continue
        if any("nll" not in x for x in (r, ref, uni)):
            raise SystemExit(f"{_cell(r)}: rows without per-window NLLs (rerun benchmarks/allocation.py)")
        if not all(_same_windows(x["base_nll"], r["base_nll"]) for x in (ref, uni)):
            raise SystemExit(f"{_cell(r)}: the rows were not measured on the same windows")
        base, nll, p, u = (torch.tensor(x, dtype=torch.float64)
                           for x in (r["base_nll"], r["nll"], ref["nll"], uni["nll"]))  # fmt: skip
        result = {"cell": _cell(r)}
        for name, n in (("first", min(first, len(base))), ("all", len(base))):
            result[name] = {
                "windows": n,
                "rise": rise(nll[:n], base[:n]),
                "bar": 0.5 * rise(p[:n], base[:n]),
                "uniform": rise(u[:n], base[:n]),
                "vs_half_palu": paired_interval(nll[:n], p[:n], base[:n], 0.5),
                "vs_uniform": paired_interval(nll[:n], u[:n], base[:n], 1.0),
            }
        results.append(result)
    return results


def markdown(results: list[dict], setting: str) -> str:
    lines = [
        f"`{setting}` against half of Palu's rule on Palu's decomposition (the bar) and against uniform;",
        "intervals are 95 % paired bootstrap intervals over the windows (2,000 draws).",
        "",
        "| model | held-out text | draw | ratio | windows | rise | bar | met | rise − bar (95 % CI) | "
        "uniform's rise | rise − uniform's (95 % CI) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        model, _, seed, text, ratio = res["cell"]
        for name in ("first", "all"):
            m = res[name]
            ci, cu = m["vs_half_palu"], m["vs_uniform"]
            lines.append(
                f"| {Path(model).name} | {text.rsplit('/', 1)[-1]} | {seed} | {ratio} | {m['windows']} | "
                f"{m['rise']:+.4f} | {m['bar']:+.4f} | {'yes' if m['rise'] <= m['bar'] else '**no**'} | "
                f"[{ci[0]:+.4f}, {ci[1]:+.4f}] | {m['uniform']:+.4f} | [{cu[0]:+.4f}, {cu[1]:+.4f}] |"
            )
    means = defaultdict(list)  # (model, text, ratio, window set) -> results over calibration draws
    for res in results:
        model, _, _, text, ratio = res["cell"]
        for name in ("first", "all"):
            means[(model, text, ratio, name)].append(res[name])
    if any(len(v) > 1 for v in means.values()):
        lines += [
            "",
            "Mean over calibration draws:",
            "",
            "| model | held-out text | ratio | windows | draws | mean rise | mean bar | met |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (model, text, ratio, _), ms in means.items():
            rise_, bar = (sum(m[k] for m in ms) / len(ms) for k in ("rise", "bar"))
            lines.append(
                f"| {Path(model).name} | {text.rsplit('/', 1)[-1]} | {ratio} | {ms[0]['windows']} | "
                f"{len(ms)} | {rise_:+.4f} | {bar:+.4f} | {'yes' if rise_ <= bar else '**no**'} |"
            )
    lines.append("")
    for model, text in dict.fromkeys((res["cell"][0], res["cell"][3]) for res in results):
        group = [res for res in results if res["cell"][0] == model and res["cell"][3] == text]
        for name in ("first", "all"):
            met = sum(res[name]["rise"] <= res[name]["bar"] for res in group)
            below = sum(res[name]["vs_half_palu"][1] < 0 for res in group)
            above = sum(res[name]["vs_half_palu"][0] > 0 for res in group)
            worse = sum(res[name]["rise"] > res[name]["uniform"] for res in group)
            clearly = sum(res[name]["vs_uniform"][0] > 0 for res in group)
            lines.append(
                f"- {Path(model).name}, {text.rsplit('/', 1)[-1]}, {group[0][name]['windows']} windows: bar "
                f"met in {met} of {len(group)} cells (interval below zero in {below}, above zero in "
                f"{above}); worse than uniform in {worse} (interval above zero in {clearly})."
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="JSON lines of benchmarks/allocation.py")
    p.add_argument("--setting", default=DEFAULT, help=f"the row label measured (default: {DEFAULT!r})")
    p.add_argument(
        "--reference-decomposition", type=json.loads, default=PALU,
        help=f"the reference row's decomposition, matched key by key (default: Palu's, {json.dumps(PALU)})",
    )  # fmt: skip
    p.add_argument("--first", type=int, default=16, help="windows of issue 8's protocol")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    args = p.parse_args()
    rows = []
    for f in args.files:
        if not f.is_file():
            raise SystemExit(f"{f}: no such file")
        for number, line in enumerate(f.read_text().splitlines(), 1):
            try:
                rows += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as e:
                raise SystemExit(f"{f}:{number}: not a JSON line of benchmarks/allocation.py ({e})") from None
    results = compare(rows, args.setting, args.reference_decomposition, args.first)
    if not results:
        raise SystemExit(f"no row of {args.setting!r} has a Palu reference and a uniform row to compare with")
    texts = list(dict.fromkeys(row["eval"] for row in rows))  # held-out texts in the order the files give
    results.sort(
        key=lambda res: (res["cell"][0], texts.index(res["cell"][3]), -res["cell"][4], res["cell"][2])
    )
    text = markdown(results, args.setting)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
