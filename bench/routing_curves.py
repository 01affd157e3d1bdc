"""The decode hit rate of mlxmoe's default cache against cache size on real routing: the
table `mlxmoe fit` forecasts from when no profile is given (mlxmoe/data/routing_curves.json).

    python bench/routing_curves.py --routing DIR        # -> mlxmoe/data/routing_curves.json
    python bench/routing_curves.py --routing DIR --out FILE

Each trace of DIR (the real-routing folder of bench/README.md, or $MLXMOE_ROUTING; the files
real_traces.py names: BigMoeOnEdge route traces, Apache-2.0; moe_ocs_learning routing, MIT)
is imported with `mlxmoe trace import`'s own function and replayed with the default policy
at each share of the model's experts (cold cache, as a first run without a profile); the hit
rate counted is the decode steps' (one token a step), which sets decode tok/s. Only these
figures are written, with their sources, not the routing itself.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from mlxmoe.caching.policies import DEFAULT_POLICY  # noqa: E402
from mlxmoe.workload.trace import import_trace, read_trace, replay  # noqa: E402
from real_traces import SOURCES  # noqa: E402  (the real-routing files, their formats and names)
from system import check_outputs, write_json  # noqa: E402

SHARES = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0)
# the mlx-lm model type of each of real_traces.py's traces (the family fit matches on)
FAMILY = {"bigmoeonedge-qwen3-30b-a3b": "qwen3_moe", "bigmoeonedge-gemma4-26b-a4b": "gemma4",
          "bigmoeonedge-gptoss-120b": "gpt_oss", "moe-ocs-qwen3.6-35b-a3b.vllm": "qwen3_5_moe",
          "moe-ocs-qwen3.6-35b-a3b.mlx": "qwen3_5_moe"}
LICENCE = {"bigmoeonedge": "github Helldez/BigMoeOnEdge c6463352, Apache-2.0",
           "moe-ocs": "github jinlong-huo/moe_ocs_learning, MIT"}


def curve(trace_file):
    header, records = read_trace(trace_file)
    total = header["num_layers"] * header["num_experts"]
    k = max(len(set(r[3])) for r in records)
    points = []
    for share in SHARES:
        size = max(k, round(total * share))
        points.append([share, round(replay(header, records, DEFAULT_POLICY, size)["decode_hit_rate"], 4)])
    return header, points


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routing", type=Path, default=os.environ.get("MLXMOE_ROUTING"),
                        help="The real-routing folder (default $MLXMOE_ROUTING).")
    parser.add_argument("--out", type=Path, default=ROOT / "mlxmoe" / "data" / "routing_curves.json")
    args = parser.parse_args()
    routing = Path(args.routing) if args.routing else None
    if routing is None or not routing.is_dir():
        raise SystemExit(f"no real-routing folder{f' at {routing}' if routing else ''}: pass --routing DIR "
                         "(or set $MLXMOE_ROUTING)")
    check_outputs({"--out": args.out}, {"--routing": routing})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, rel, name in SOURCES:
            out = Path(tmp) / f"{name}.trace.jsonl"
            import_trace(fmt, routing / rel, out)
            header, points = curve(out)
            source = f"{name} ({rel}), {LICENCE[fmt]}"
            rows.append({"family": FAMILY[name], "source": source, "layers": header["num_layers"],
                         "experts": header["num_experts"], "decode_hit_rate": points})
            print(f"{FAMILY[name]:12s} " + "  ".join(f"{100 * s:3.0f}%: {100 * r:5.1f}%" for s, r in points)
                  + f"   {source}")
    doc = {"what": "decode hit rate of mlxmoe's default cache (cold, no profile) against the share of a model's "
                   "experts it holds, replayed on routing recorded from real models; made by bench/routing_curves.py",
           "policy": DEFAULT_POLICY, "curves": rows}
    write_json(args.out, doc)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
