"""A prompt far longer than one prefill step at a budget near the minimum: bytes read per
prompt token against the bound, for the prefill step mlxmoe chooses and for fixed ones.

Each prefill step's layer call reads each of its distinct experts at most once (more
distinct experts than slots: in groups that fit, each read once), so the bound of a run is
the sum over its layer calls (the prompt's steps and the one token generated) of their
distinct experts' bytes on disk; the fewer
and longer the steps, the fewer times a small cache reads the same experts again. For each
configuration (`auto`: the step api.prefill_step picks from the budget's working memory;
a number: mlx-lm's prefill_step_size forced to it) the model is loaded at the budget, the
prompt prefilled (one token generated) and the row gives: the steps, the bytes the store
read and the bound, both per prompt token, read / bound, the peak memory against the
budget, the seconds (load beside them) and, with --disk-mbps, the bound's seconds at that
rate. Counts do not depend on the machine's load; seconds do.

    python bench/bench_prefill.py                                   # the demo model, a 10k-token prompt
    python bench/bench_prefill.py --checkpoint PATH --tokens 4000 --steps auto,26,512
    python bench/bench_prefill.py --output prefill.json             # also all rows as JSON

The prompt is this repository's own prose (README.md and docs/design.md, repeated as far as
needed): text the model's tokenizer was not trained to fit.
"""

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

import mlxmoe  # noqa: E402
from mlxmoe.api import memory_plan, prefill_step  # noqa: E402
from mlxmoe.budget import DEFAULT_CONTEXT, format_size  # noqa: E402
from system import check_outputs, model_folder, write_json  # noqa: E402


def prompt_ids(tokenizer, tokens: int) -> list:
    """`tokens` token ids of the repository's prose, repeated as far as needed."""
    text = "\n\n".join((ROOT / name).read_text() for name in ("README.md", "docs/design.md"))
    ids = tokenizer.encode(text)
    return (ids * (tokens // len(ids) + 1))[:tokens]


def run(checkpoint: str, budget: int, ids: list, step) -> dict:
    """One prefill of `ids` at `budget` with prefill step `step` ("auto" or tokens)."""
    model, tokenizer = mlxmoe.load(checkpoint, memory_budget=budget, max_context=context(ids))
    cache, store = model.expert_cache, model.expert_cache.store
    calls = []  # (tokens, distinct experts) of each layer call
    cache.watch(lambda call: calls.append((call.tokens, len(call.experts))))
    chosen = prefill_step(model.expert_runtime.plan, tokenizer, ids) if step == "auto" else int(step)
    try:
        before = store.io_stats()["useful_bytes"]
        tic = time.perf_counter()
        kwargs = {} if step == "auto" else {"prefill_step_size": chosen}
        for _ in mlxmoe.stream_generate(model, tokenizer, ids, max_tokens=1, **kwargs):
            pass
        seconds = time.perf_counter() - tic
        cache.flush()
        read = store.io_stats()["useful_bytes"] - before
        stats = cache.stats()
    finally:
        cache.close()
    bound = sum(n for _, n in calls) * store.expert_file_bytes()
    steps = sum(t > 1 for t, _ in calls) // max(1, store.num_layers)
    return {"step": str(step), "step_tokens": chosen, "steps": steps,
            "prompt_tokens": len(ids), "read_bytes": read, "bound_bytes": bound, "seconds": seconds,
            "peak_memory": stats["peak_memory"], "budget": budget, "cache_experts": cache.capacity}


def context(ids: list) -> int:
    """The context the budget reserves KV for: the prompt and the token generated."""
    return max(DEFAULT_CONTEXT, len(ids) + 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(ROOT / "mlxmoe" / "demo"))
    ap.add_argument("--tokens", type=int, default=10000, help="Prompt tokens.")
    ap.add_argument("--steps", default="auto,26,512", help="Comma-separated: auto, or prefill step sizes in tokens "
                    "(26: the step the rule before gave a 10k-token prompt on the demo model).")
    ap.add_argument("--cache-over-minimum", type=int, default=2,
                    help="The budget: the model's minimum plus this many experts' slots.")
    ap.add_argument("--disk-mbps", type=float, default=None, help="Also the bound's seconds at this rate (MB/s).")
    ap.add_argument("--output", default=None, help="All rows as JSON.")
    args = ap.parse_args()
    check_outputs({"--output": args.output}, {"--checkpoint": model_folder(args.checkpoint)})
    _, tokenizer = mlxmoe.load(args.checkpoint, memory_budget="64GB")
    ids = prompt_ids(tokenizer, args.tokens)
    minimal = memory_plan(args.checkpoint, memory_budget="64GB", max_context=context(ids))
    budget = minimal.minimum + args.cache_over_minimum * minimal.slot_bytes
    print(f"checkpoint {args.checkpoint}; budget {format_size(budget)} (minimum {format_size(minimal.minimum)} "
          f"+ {args.cache_over_minimum} experts); load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
          flush=True)
    rows = [run(args.checkpoint, budget, ids, step) for step in args.steps.split(",")]
    head = ["step", "tokens a step", "steps", "cache", "read KB/token", "bound KB/token", "read/bound",
            "peak/budget", "seconds"] + (["bound s"] if args.disk_mbps else [])
    print(f"\nprefill of a {len(ids)}-token prompt near the minimum budget ({os.getloadavg()[0]:.2f} load at the end)")
    print("  ".join(head))
    for r in rows:
        cells = [r["step"], r["step_tokens"], r["steps"], r["cache_experts"], f"{r['read_bytes'] / len(ids) / 1e3:.1f}",
                 f"{r['bound_bytes'] / len(ids) / 1e3:.1f}", f"{r['read_bytes'] / max(1, r['bound_bytes']):.3f}",
                 f"{r['peak_memory'] / r['budget']:.2f}", f"{r['seconds']:.1f}"]
        if args.disk_mbps:
            cells.append(f"{r['bound_bytes'] / (args.disk_mbps * 1e6):.1f}")
        print("  ".join(str(c).rjust(len(h)) for c, h in zip(cells, head)))
    if args.output:
        write_json(args.output, rows)
        print(f"saved {args.output}")


if __name__ == "__main__":
    main()
