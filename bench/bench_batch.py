"""Batched serving (`mlxmoe serve --max-batch N`) against `mlx_lm.server` and against
`--max-batch 1` (one request at a time) on the same checkpoint, side by side in one run:

1. for 1, 4, 8 and 16 concurrent streaming completion clients (each its own held-out
   prompts, greedy, --max-tokens each, no KV caches kept across requests): requests/s and the
   median per-request tok/s (its completion tokens over its time) of
   - `mlx_lm`: stock mlx_lm.server (it batches concurrent requests),
   - `batched`: mlxmoe serve --max-batch 16 with every expert resident (the default load of the
     demo model: the budget holds them all),
   - `one`: mlxmoe serve --max-batch 1,
   rounds alternated between the servers, medians, and the ratios batched/mlx_lm and batched/one;
   with --partial-throughput, `batched` and `one` at --partial-budget, and beside them stock
   mlx_lm.server one request at a time (--decode-concurrency 1): stock's own gain from batching
   on this workload (the prompts' prefill does not batch away: it bounds what batching gives);
2. as the batch grows, at a partial cache (--memory-budget, the demo's 46MB: 57 of 128
   experts): the experts the requests used (hits + misses: each row's distinct experts per
   layer call, as a request alone counts them) and the bytes read, per generated token, from
   /v1/mlxmoe/stats around each round.

    python bench/bench_batch.py [--model DIR] [--rounds 3] [--clients 1,4,8,16]
    python bench/bench_batch.py --rounds 1 --requests 1 --max-tokens 4 --clients 1,2   # smoke run
"""

import argparse
import http.client
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import bench_server  # noqa: E402
from bench_server import Server  # noqa: E402
from heldout import prompts  # noqa: E402
from system import check_outputs, model_folder, write_json  # noqa: E402


def complete(port, prompt, max_tokens):
    """(completion tokens, seconds) of one streaming completion request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    tic = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": "default_model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}))
    r = conn.getresponse()
    tokens = None
    for line in r:
        if line.startswith(b"data: {") and b'"usage"' in line:
            usage = json.loads(line[6:]).get("usage")
            tokens = usage["completion_tokens"] if usage else tokens
        if line.startswith(b"data: [DONE]"):
            break
    conn.close()
    if tokens is None:
        raise RuntimeError(f"no usage in the answer to {prompt[:40]!r} (HTTP {r.status})")
    return tokens, time.perf_counter() - tic


class Completions:
    """A server as bench_server.load_round asks it: each request's (tok/s, seconds), streaming
    completions; `tokens`: the completion tokens it was answered."""

    def __init__(self, server):
        self.port, self.tokens = server.port, 0

    def stream(self, prompt, max_tokens):
        tokens, seconds = complete(self.port, prompt, max_tokens)
        self.tokens += tokens
        return tokens / seconds, seconds


def load_round(server, clients, requests, pool, max_tokens):
    """`clients` clients, each `requests` requests in turn: (requests/s, [tok/s per request], tokens)."""
    counted = Completions(server)
    rps, tps = bench_server.load_round(counted, clients, requests, pool, max_tokens)
    return rps, tps, counted.tokens


def throughput(args, pool, clients_list, budget=None):
    """req/s and tok/s per request: every expert resident against mlx_lm.server, or at the
    memory `budget` against --max-batch 1, with what batching gives stock mlx_lm.server itself
    on the same workload (every expert resident, --decode-concurrency 16 against 1): the
    prompts' prefill is not batched away, so it bounds what batching can give."""
    mlxmoe = [sys.executable, "-m", "mlxmoe", "serve", "--model", args.model, "--prompt-cache-size", "0"]
    stock = [sys.executable, "-m", "mlx_lm", "server", "--model", args.model, "--prompt-cache-size", "0"]
    servers = {"mlx_lm": Server(stock + ["--decode-concurrency", "16"])}
    if budget is not None:
        servers["mlx_lm_one"] = Server(stock + ["--decode-concurrency", "1"])
        mlxmoe += ["--memory-budget", budget]
    servers["batched"] = Server(mlxmoe + ["--max-batch", "16"])
    servers["one"] = Server(mlxmoe + ["--max-batch", "1"])
    rows = []
    try:
        for s in servers.values():  # warm-up: compile, caches
            load_round(s, 2, 1, pool, args.max_tokens)
        for clients in clients_list:
            runs = {name: [] for name in servers}
            for r in range(args.rounds):
                names = list(servers)
                for name in names[r % len(names):] + names[:r % len(names)]:  # rotated each round
                    runs[name].append(load_round(servers[name], clients, args.requests, pool, args.max_tokens))
            row = {"clients": clients}
            for name, results in runs.items():
                row[f"{name}_rps"] = statistics.median(rps for rps, _, _ in results)
                row[f"{name}_tps"] = statistics.median(t for _, ts, _ in results for t in ts)
            row["vs_mlx_lm"] = row["batched_rps"] / row["mlx_lm_rps"]
            row["vs_one"] = row["batched_rps"] / row["one_rps"]
            row["stock_gain"] = row["mlx_lm_rps"] / row["mlx_lm_one_rps"] if budget is not None else None
            rows.append(row)
            at = f" at {budget}" if budget else ""
            gain = (f"; stock mlx_lm.server batched / one at a time {row['stock_gain']:.2f}x "
                    f"({row['mlx_lm_rps']:.2f} / {row['mlx_lm_one_rps']:.2f} req/s, every expert resident)"
                    if budget is not None else "")
            print(f"{clients:>2} clients{at}: req/s batched {row['batched_rps']:.2f}, mlx_lm.server "
                  f"{row['mlx_lm_rps']:.2f}, --max-batch 1 {row['one_rps']:.2f} (batched/mlx_lm "
                  f"{row['vs_mlx_lm']:.2f}x, batched/one {row['vs_one']:.2f}x){gain}; tok/s per request batched "
                  f"{row['batched_tps']:.1f}, one {row['one_tps']:.1f}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    return rows


def reads_per_token(args, pool, clients_list):
    server = Server([sys.executable, "-m", "mlxmoe", "serve", "--model", args.model, "--max-batch", "16",
                     "--memory-budget", args.partial_budget, "--prefetch", "0"])
    rows = []
    try:
        load_round(server, 1, 1, pool, args.max_tokens)  # warm-up

        def stats():
            return json.loads(server.post("GET", "/v1/mlxmoe/stats")[2])

        for clients in clients_list:
            before = stats()
            _, _, tokens = load_round(server, clients, args.requests, pool, args.max_tokens)
            time.sleep(0.5)  # (the batch has emptied: the stats are the cache's own)
            after = stats()
            experts = after["hits"] + after["misses"] - before["hits"] - before["misses"]
            read = after["bytes_read"] - before["bytes_read"]
            rows.append({"clients": clients, "experts_per_token": experts / tokens, "bytes_per_token": read / tokens})
            print(f"{clients:>2} clients at {args.partial_budget}: {experts / tokens:.1f} experts used and "
                  f"{read / tokens / (1 << 20):.3f} MiB read per generated token", flush=True)
    finally:
        server.stop()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "mlxmoe" / "demo"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4, help="requests per client per round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--partial-budget", default="46MB", help="the partial cache's --memory-budget (reads per token)")
    ap.add_argument("--partial-throughput", action="store_true",
                    help="Throughput at --partial-budget instead (batched against --max-batch 1), and its reads.")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "batch.json"))
    args = ap.parse_args()
    check_outputs({"--out": args.out}, {"--model": model_folder(args.model)})
    clients = [int(c) for c in args.clients.split(",")]
    pool = [p for lang in ("en", "it", "de", "fr", "es") for p in prompts(lang, 8, max_chars=200)]
    budget = args.partial_budget if args.partial_throughput else None
    results = {"args": vars(args), "throughput": throughput(args, pool, clients, budget),
               "reads": reads_per_token(args, pool, clients)}
    write_json(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
