"""Plots for the README, as SVG (no plotting dependency): hit rate against cache size of
every policy and Belady's MIN, by replay, on a synthetic trace with Qwen3-30B-A3B's heat
(bench/traces.py) and on the demo model's Italian and English held-out traces (recorded
by `python bench/bench_policies.py --demo` into bench/out/). Also the Italian profile's
heatmap (`mlxmoe profile show --png`).

    python bench/plots.py            # writes bench/plots/*.svg and *.png (about 3 minutes)
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from system import check_outputs, write_atomic  # noqa: E402
from traces import HEAT, load_heat, synthetic_records  # noqa: E402

from mlxmoe.caching.policies import ONLINE  # noqa: E402
from mlxmoe.workload.heatmap import write_heatmap_png  # noqa: E402
from mlxmoe.workload.profile import ActivationProfile  # noqa: E402
from mlxmoe.workload.trace import read_trace, replay  # noqa: E402

HERE = Path(__file__).resolve().parent
PLOTS = ("policies-synthetic.svg", "policies-demo-it.svg", "policies-demo-en.svg", "italian-profile-heatmap.png")
SHARES = (0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9)
COLORS = {"lru": "#7f7f7f", "lfu": "#bcbd22", "slru": "#1f77b4", "s3fifo": "#9467bd", "activation": "#d62728",
          "belady": "#000000"}


def curves(header, records, shares=SHARES):
    """{policy: [(share, hit rate)]} for every online policy and Belady."""
    L, E = header["num_layers"], header["num_experts"]
    out = {}
    for name in ONLINE + ["belady"]:
        out[name] = [(s, replay(header, records, name, max(int(L * E * s), 8))["hit_rate"]) for s in shares]
        print(f"  {name}: " + " ".join(f"{100 * r:.1f}" for _, r in out[name]), flush=True)
    return out


def line_chart(path, title, series, xlabel="share of all experts cached", ylabel="hit rate",
               width=640, height=400):
    """A line chart of {name: [(x, y)]} (x and y in 0..1) as an SVG file."""
    left, right, top, bottom = 60, 120, 40, 50
    w, h = width - left - right, height - top - bottom
    ys = [y for pts in series.values() for _, y in pts]
    y0 = max(0.0, (int(min(ys) * 10) / 10))
    X = lambda x: left + w * x  # noqa: E731
    Y = lambda y: top + h * (1 - (y - y0) / (1 - y0))  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">{title}</text>']
    for i in range(11):  # grid and ticks
        x = i / 10
        out.append(f'<line x1="{X(x):.1f}" y1="{top}" x2="{X(x):.1f}" y2="{top + h}" stroke="#eee"/>')
        out.append(f'<text x="{X(x):.1f}" y="{top + h + 16}" text-anchor="middle">{int(x * 100)}%</text>')
    steps = int(round((1 - y0) * 10))
    for i in range(steps + 1):
        y = y0 + i / 10
        out.append(f'<line x1="{left}" y1="{Y(y):.1f}" x2="{left + w}" y2="{Y(y):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{Y(y) + 4:.1f}" text-anchor="end">{int(round(y * 100))}%</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#444"/>')
    out.append(f'<text x="{left + w / 2}" y="{height - 12}" text-anchor="middle">{xlabel}</text>')
    out.append(f'<text transform="translate(16,{top + h / 2}) rotate(-90)" text-anchor="middle">{ylabel}</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS.get(name, "#2ca02c")
        dash = ' stroke-dasharray="5,4"' if name == "belady" else ""
        wide = 2.5 if name == "activation" else 1.5
        d = " ".join(f"{'M' if j == 0 else 'L'}{X(x):.1f},{Y(y):.1f}" for j, (x, y) in enumerate(pts))
        out.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="{wide}"{dash}/>')
        ly = top + 14 + 18 * i
        out.append(f'<line x1="{left + w + 12}" y1="{ly - 4}" x2="{left + w + 32}" y2="{ly - 4}" '
                   f'stroke="{color}" stroke-width="{wide}"{dash}/>')
        out.append(f'<text x="{left + w + 38}" y="{ly}">{name}</text>')
    out.append("</svg>")
    write_atomic(path, "\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "plots")
    args = ap.parse_args()
    traces = {lang: HERE / "out" / f"demo-{lang}.trace.jsonl" for lang in ("it", "en")}
    profile_file = HERE.parent / "profiles" / "italian.json"
    check_outputs({"--out": [args.out / name for name in PLOTS]},
                  {"the heat": HEAT, "the demo traces": list(traces.values()), "the profile": profile_file})
    heat, k = load_heat()
    print("synthetic Qwen3-30B-A3B heat, 16 layers x 128 experts, 800 tokens, seed 0")
    header = {"num_layers": 16, "num_experts": heat.shape[1], "top_k": k}
    line_chart(args.out / PLOTS[0], "Hit rate by cache size: synthetic Qwen3-30B-A3B routing",
               curves(header, synthetic_records(heat, k, 800, layers=16, seed=0)))
    for lang, name in (("it", "Italian"), ("en", "English")):
        path = traces[lang]
        if not path.exists():
            print(f"{path} missing: run python bench/bench_policies.py --demo first")
            continue
        print(f"demo model, {name} held-out text")
        line_chart(args.out / f"policies-demo-{lang}.svg", f"Hit rate by cache size: demo model, {name} held-out text",
                   curves(*read_trace(path)))
    profile = ActivationProfile.load(profile_file)
    write_heatmap_png(args.out / PLOTS[3], profile.rates(),
                      f"{profile.workload!r} on {profile.model}: activations per token")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
