"""Import the real routing the policy benchmarks score (`mlxmoe trace import`), under the
names the figures in bench/RESULTS.md use.

SRC is a copy of the development data `real-routing/` (its README names each file's origin
and licence: BigMoeOnEdge's route-trace CSVs of Qwen3-30B-A3B, Gemma-4-26B-A4B and
gpt-oss-120b, moe_ocs_learning's Qwen3.6-35B-A3B recorded by vLLM and by MLX); OUT is the
folder the benchmarks then take (`--traces OUT/*.trace.jsonl`, profile_priming.py's
`--traces OUT`). The Mixtral-8x7B traces of earlier figures (speculative-moe's dev problems)
are not part of that data.

    python bench/real_traces.py /path/to/real-routing traces/
"""

import argparse
import subprocess
import sys
from pathlib import Path

SOURCES = [  # (format, file under SRC, trace name)
    ("bigmoeonedge", "bigmoeonedge/qwen.route.csv", "bigmoeonedge-qwen3-30b-a3b"),
    ("bigmoeonedge", "bigmoeonedge/gemma.route.csv", "bigmoeonedge-gemma4-26b-a4b"),
    ("bigmoeonedge", "bigmoeonedge/gptoss.route.csv", "bigmoeonedge-gptoss-120b"),
    ("moe-ocs", "moe-ocs-learning-qwen3.6/routing_pretrained.vllm.7534a717.json", "moe-ocs-qwen3.6-35b-a3b.vllm"),
    ("moe-ocs", "moe-ocs-learning-qwen3.6/routing_pretrained.mlx.ece94543.json", "moe-ocs-qwen3.6-35b-a3b.mlx"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="the real-routing folder")
    ap.add_argument("out", type=Path, help="folder for the traces")
    args = ap.parse_args()
    missing = [str(args.src / path) for _, path, _ in SOURCES if not (args.src / path).exists()]
    if missing:
        sys.exit(f"not found: {', '.join(missing)} (SRC is the real-routing folder, see --help)")
    args.out.mkdir(parents=True, exist_ok=True)
    for fmt, path, name in SOURCES:
        subprocess.run([sys.executable, "-m", "mlxmoe", "trace", "import", fmt, str(args.src / path), "-o",
                        str(args.out / f"{name}.trace.jsonl")], check=True)


if __name__ == "__main__":
    main()
