"""Speculative decoding on the demo model (or --model): decode tokens/s and the drafts'
acceptance without drafts, with n-gram drafting (--draft ngram) and with a draft model
(--draft-model; default: the model drafting for itself, which bounds what a draft model can
give), on two tasks:

- repeat: a held-out paragraph given twice, then its first words: the continuation repeats
  the prompt (what n-gram drafting is for: editing code, quoting a given text);
- chat: held-out openings as chat messages, answered freely (n-gram drafting must turn
  itself off there: never below 0.95x).

Each configuration runs in its own process (one model loaded at a time: no background reads
of another model share the CPU), configurations alternated over --rounds; greedy, --tokens
per prompt, the expert cache at --cache-experts (default: half the experts; 0: all resident).
Prints per task and configuration the median decode tok/s, its ratio to no drafts, the
acceptance (accepted / drafted tokens) and whether every output equals the one without drafts.

    python bench/bench_speculative.py                      # ~10 min on a shared 2-core CPU
    python bench/bench_speculative.py --tokens 8 --rounds 1 --prompts 1   # smoke run

Where the host is the bottleneck, as on a GPU, a step verifying T tokens costs about one step
(--step-costs); the checkpoint that is so here (bench_host.py's) has random weights, whose
greedy output loops. --answers REAL_ROUTING makes it answer as real text does (bench/answers.py:
the repeat task's paragraph repeated, Qwen3.6-35B-A3B's recorded answers for chat), and
--routing FILE makes its MoE layers route as a real model did (bench/routed.py):

    python bench/bench_speculative.py --model BUNDLED6 --draft-model STACKED6 --answers ../shared/data/real-routing \
        --routing ../shared/data/real-routing/bigmoeonedge/qwen.route.csv --prompts 2 --tokens 120 --cache-experts 0

(BUNDLED6 / STACKED6: bench_host.py's host-bound-48x128-top6 checkpoint, bundled / as mlx-lm saves it;
a draft model must be one mlx-lm loads. Chat has the recording's 2 answers whatever --prompts.)
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import answers  # noqa: E402
import routed  # noqa: E402
from heldout import prompts  # noqa: E402

CONFIGS = ("none", "ngram", "draft")


def task_prompts(tokenizer, task, n):
    """The prompts of `task` as token ids."""
    if task == "repeat":
        return [tokenizer.encode(f"{t}\n\n{t}\n\n{' '.join(t.split()[:6])}") for t in answers.repeat_texts(n)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": p[:120]}], add_generation_prompt=True)
            for lang in ("en", "it") for p in prompts(lang, n)][:n]


def task_sequences(args, tokenizer, task):
    """[(prompt ids, the whole sequence the model answers as, or None where it answers freely)]."""
    if not args.answers:
        return [(ids, None) for ids in task_prompts(tokenizer, task, args.prompts)]
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    return answers.sequences(tokenizer, task, args.prompts, args.answers, vocab)


def worker(args):
    """One configuration in this process: prints one JSON line per task."""
    import mlxmoe

    kw = {} if args.cache_experts == 0 else {"cache_experts": args.cache_experts}
    if args.config == "draft":
        kw["draft_model"] = args.draft_model or args.model
    if args.routing:
        routed.install(args.routing, "")
    model, tokenizer = mlxmoe.load(args.model, **kw)
    runtime = model.expert_runtime
    answering = {"sequence": [0, 1]}
    if args.answers:
        for m in (model, runtime.draft_model) if args.config == "draft" else (model,):
            answers.answer_as(m, answering)
    draft = {"none": {}, "ngram": {"draft_model": "ngram"},
             "draft": {"draft_model": runtime.draft_model}}[args.config]
    if args.num_draft:
        draft["num_draft_tokens"] = args.num_draft
    for r in mlxmoe.stream_generate(model, tokenizer, "Warm up", max_tokens=4):  # kernels compiled, caches warm
        pass
    for task in ("repeat", "chat"):
        runtime.cache.reset_stats()
        outputs, tokens, seconds, as_answered = [], 0, 0.0, True
        for ids, whole in task_sequences(args, tokenizer, task):
            answering["sequence"], most = whole, args.tokens if whole is None else len(whole) - len(ids)
            tic, first, out = time.perf_counter(), None, []
            for r in mlxmoe.stream_generate(model, tokenizer, ids, max_tokens=min(args.tokens, most), **draft):
                first = first or time.perf_counter()
                out.append(r.token)
            outputs.append(out)
            as_answered &= whole is None or out == whole[len(ids):len(ids) + len(out)]
            tokens += len(out) - 1
            seconds += time.perf_counter() - first
        stats = runtime.cache.stats()
        print(json.dumps({"task": task, "tps": tokens / seconds if seconds else 0.0, "outputs": outputs,
                          "drafted": stats["drafted"], "accepted": stats["accepted"], "as_answered": as_answered}),
              flush=True)
    runtime.close()


def run(args, config):
    cmd = [sys.executable, __file__, "--worker", config, "--model", args.model, "--tokens", str(args.tokens),
           "--prompts", str(args.prompts), "--cache-experts", str(args.cache_experts),
           "--num-draft", str(args.num_draft or 0)] + (["--draft-model", args.draft_model] if args.draft_model else []) \
        + (["--answers", args.answers] if args.answers else []) + (["--routing", args.routing] if args.routing else [])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        sys.exit(f"{config} failed:\n{proc.stderr[-2000:]}")
    return {r["task"]: r for r in map(json.loads, proc.stdout.splitlines())}


def step_costs(model_path, sizes=(1, 2, 4, 6)):
    """Stock mlx-lm's forward of T tokens over a 200-token KV cache, each size timed 30 times
    (medians, ms): what a step verifying T - 1 drafts costs against a one-token step."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    from mlxmoe.backend import detect

    model, _ = mlx_lm.load(model_path)
    detect().apply_dtype_policy(model)
    kv = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(1, 200))]), cache=kv))
    costs = {}
    for t in sizes:
        times = []
        for _ in range(30):
            tic = time.perf_counter()
            mx.eval(model(mx.array([[5] * t]), cache=kv))
            times.append(time.perf_counter() - tic)
            for c in kv:
                c.trim(t)
        costs[t] = 1000 * statistics.median(times)
    return costs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="Default: the bundled demo model.")
    ap.add_argument("--draft-model", help="Default: the model itself (an upper bound on acceptance).")
    ap.add_argument("--tokens", type=int, default=128, help="Tokens generated per prompt.")
    ap.add_argument("--prompts", type=int, default=4, help="Prompts per task.")
    ap.add_argument("--rounds", type=int, default=3, help="Rounds, the configurations alternated in each.")
    ap.add_argument("--cache-experts", type=int, help="Expert cache size (0: every expert; default: half).")
    ap.add_argument("--num-draft", type=int, help="Tokens drafted a step (default: mlxmoe's, 3 / 5).")
    ap.add_argument("--step-costs", action="store_true",
                    help="Only time stock mlx-lm's forward of 1, 2, 4 and 6 tokens (a verify step's cost).")
    ap.add_argument("--answers", metavar="REAL_ROUTING", help="the model answers as real text does (bench/answers.py; "
                    "chat: the recorded answers in this real-routing folder), its logits replaced, its layers' "
                    "work kept: for a checkpoint with random weights")
    ap.add_argument("--routing", help="[FORMAT:]FILE: the model's MoE layers route as this recording (bench/routed.py)")
    ap.add_argument("--worker", choices=CONFIGS, dest="config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        import mlxmoe

        args.model = str(mlxmoe.DEMO_MODEL)
    if args.cache_experts is None:
        from mlxmoe.api import model_info

        info = model_info(args.model)
        args.cache_experts = info["moe_layers"] * info["experts_per_layer"] // 2
    if args.config:
        return worker(args)
    if args.step_costs:
        costs = step_costs(args.model)
        print("stock mlx-lm, a forward of T tokens: " + ", ".join(
            f"T={t} {ms:.1f} ms ({ms / costs[1]:.2f}x T=1)" for t, ms in costs.items()))
        return
    results = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):
        for config in CONFIGS:
            results[config].append(run(args, config))
    print(f"{args.model}: cache {args.cache_experts or 'all'} experts, {args.prompts} prompts x {args.tokens} tokens, "
          f"{args.rounds} rounds (medians)")
    print(f"{'task':<8}{'config':<8}{'tok/s':>8}{'ratio':>8}{'accepted':>10}{'drafted':>9}{'rate':>7}  same output")
    for task in ("repeat", "chat"):
        base = statistics.median(r[task]["tps"] for r in results["none"])
        for config in CONFIGS:
            runs = [r[task] for r in results[config]]
            tps = statistics.median(r["tps"] for r in runs)
            drafted, accepted = runs[-1]["drafted"], runs[-1]["accepted"]
            same = all(r["outputs"] == results["none"][0][task]["outputs"] and r.get("as_answered", True)
                       for r in runs)
            rate = f"{accepted / drafted:.2f}" if drafted else "-"
            print(f"{task:<8}{config:<8}{tps:>8.1f}{tps / base:>7.2f}x{accepted:>10}{drafted:>9}{rate:>7}  {same}")


if __name__ == "__main__":
    main()
