"""Batched serving (`mlxmoe serve --max-batch N`) against `mlx_lm.server` and against
`--max-batch 1` (one request at a time) on the same checkpoint, side by side in one run:

1. for 1, 4, 8 and 16 concurrent streaming completion clients (each its own held-out
   prompts, greedy, --max-tokens each, no KV caches kept across requests): requests/s, the
   median per-request tok/s (its completion tokens over its time) and the generated tok/s while
   some request decodes (decode_rate: the time in which only prompts are prefilled left out) of
   - `mlx_lm`: stock mlx_lm.server (it batches concurrent requests),
   - `batched`: mlxmoe serve --max-batch 16 with every expert resident (the default load of the
     demo model: the budget holds them all),
   - `one`: mlxmoe serve --max-batch 1,
   rounds alternated between the servers, medians, and the ratios batched/mlx_lm and batched/one;
   with --partial-throughput, `batched` and `one` at --partial-budget, and beside them stock
   mlx_lm.server one request at a time (--decode-concurrency 1 --prompt-concurrency 1: mlx-lm's
   BatchGenerator decodes as many as it prefills together): stock's own gain from batching
   on this workload, what batching can give here (the longer the prompts, the less: on this CPU
   their prefill costs about as much batched as one at a time; --prompt-chars shortens them);
   and the batching server's MLX peak memory over its life against its budget (issue 45: within
   +5 % with 16 clients);
2. as the batch grows, at a partial cache (--memory-budget, the demo's 46MB: 57 of 128
   experts): the experts the requests used (hits + misses: each row's distinct experts per
   layer call, as a request alone counts them) and the bytes read, per generated token, from
   /v1/mlxmoe/stats around each round.

--rtt S[,S...] runs 1. under an emulated round trip to the device of S us (bench/roundtrip.py,
on each server's generation thread, stock and mlxmoe alike): a step's waits are paid once for
all its rows, so batching gains what the waits cost (waits per generated token printed; each
server's counts in OUT.NAME.waits.json beside --out).
Each server's greedy answers to a prompt must be one and the same; batched against
--max-batch 1 is checked and printed.

    python bench/bench_batch.py [--model DIR] [--rounds 3] [--clients 1,4,8,16]
    python bench/bench_batch.py --rounds 1 --requests 1 --max-tokens 4 --clients 1,2   # smoke run
    python bench/bench_batch.py --model BUNDLED --stock-model STACKED --partial-throughput \
        --partial-budget 71MB --clients 1,8 --rtt 0,150,1000             # issue 45's 50 % row
    ... --routing ../shared/data/real-routing/bigmoeonedge/qwen.route.csv   # as a real model routes

--routing makes every server's model route as a recording of a real model (bench/routed.py):
each request's rows at their positions moved by their input tokens, so that the requests of a
batch route as distinct steps of the real model, alone as in the batch (the checkpoint must have
the recording's top-k: bench_host.py's 48x128-top6 for Qwen3-30B-A3B's).
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
import routed  # noqa: E402
from heldout import prompts  # noqa: E402
from system import check_outputs, clean_stale, cpu_ticks, model_folder, stolen_share, write_json  # noqa: E402


def complete(port, prompt, max_tokens):
    """(completion tokens, seconds, text, (first token's time, last token's time)) of one streaming
    completion request (times: time.perf_counter's)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    tic = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": "default_model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}))
    r = conn.getresponse()
    tokens, text, times = None, [], []
    for line in r:
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                times.append(time.perf_counter())
            text += [c.get("text") or "" for c in chunk.get("choices") or []]
            tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
        if line.startswith(b"data: [DONE]"):
            break
    conn.close()
    if tokens is None:
        raise RuntimeError(f"no usage in the answer to {prompt[:40]!r} (HTTP {r.status})")
    return tokens, time.perf_counter() - tic, "".join(text), (times[0], times[-1]) if times else None


class Completions:
    """A server as bench_server.load_round asks it: each request's (tok/s, seconds), streaming
    completions; `tokens`: the completion tokens it was answered; `texts`: prompt -> answer;
    `spans`: each request's (first token's time, last token's, tokens)."""

    def __init__(self, server, texts):
        self.port, self.tokens, self.texts, self.spans = server.port, 0, texts, []

    def stream(self, prompt, max_tokens):
        tokens, seconds, text, span = complete(self.port, prompt, max_tokens)
        self.tokens += tokens
        self.texts.setdefault(prompt, set()).add(text)
        if span is not None:
            self.spans.append((*span, tokens))
        return tokens / seconds, seconds


def decode_rate(spans):
    """Generated tok/s while decoding: the tokens after each request's first, over the time in
    which some request was between its first token and its last (the union of those spans).
    Unlike req/s it leaves out the time in which only prompts were prefilled."""
    tokens, seconds, end = sum(n - 1 for _, _, n in spans), 0.0, None
    for first, last, _ in sorted(spans):
        if end is None or first > end:
            seconds, end = seconds + last - first, last
        elif last > end:
            seconds, end = seconds + last - end, last
    return tokens / seconds if seconds > 0 else None


def load_round(server, clients, requests, pool, max_tokens, texts=None):
    """`clients` clients, each `requests` requests in turn: (requests/s, [tok/s per request],
    tokens, generated tok/s while decoding)."""
    counted = Completions(server, {} if texts is None else texts)
    rps, tps = bench_server.load_round(counted, clients, requests, pool, max_tokens)
    return rps, tps, counted.tokens, decode_rate(counted.spans)


def launch(argv, rtt, report, routing=None):
    """A server (`python -m` argv) with the emulated round trip `rtt` us on its generation
    thread (bench/roundtrip.py, its counts in `report`), or as it is (rtt None); with `routing`
    (a recording), its model routes as the recording does (roundtrip.py --routing)."""
    if rtt is None and routing is None:
        return Server([sys.executable, "-m", *argv])
    wrapper = [sys.executable, str(ROOT / "bench" / "roundtrip.py"), "--rtt", str(rtt or 0)]
    if routing:
        wrapper += ["--routing", routing]
    if rtt is not None:
        Path(report).unlink(missing_ok=True)
        wrapper += ["--report", report]
    server = Server([*wrapper, "-m", *argv])
    server.report = report if rtt is not None else None
    return server


def stop(servers):
    """Stop `servers`; what a report thread killed mid-write left beside its report goes too."""
    for server in servers:
        server.stop()
        if getattr(server, "report", None):
            clean_stale(server.report)


def device_waits(server):
    """The waits on the device its generation thread made so far (None without a round trip)."""
    report = getattr(server, "report", None)
    if report is None:
        return None
    time.sleep(0.6)  # (written twice a second)
    return json.loads(Path(report).read_text())["waits"]


def throughput(args, pool, clients_list, budget=None, rtt=None):
    """req/s and tok/s per request: every expert resident against mlx_lm.server, or at the
    memory `budget` against --max-batch 1, with what batching gives stock mlx_lm.server itself
    on the same workload (every expert resident, --decode-concurrency 16 against 1 with
    --prompt-concurrency 1): what batching can give here. With `rtt` (us), every server under
    the emulated round trip, and its waits per generated token."""
    mlxmoe = ["mlxmoe", "serve", "--model", args.model, "--prompt-cache-size", "0"]
    stock = ["mlx_lm", "server", "--model", args.stock_model or args.model, "--prompt-cache-size", "0"]
    out = Path(args.out)
    report = lambda name: str(out.with_name(f"{out.stem}.{name}.waits.json"))  # noqa: E731
    servers = {"mlx_lm": launch(stock + ["--decode-concurrency", "16"], rtt, report("mlx_lm"), args.routing)}
    if budget is not None:
        # (BatchGenerator's batch is the larger of the two: both 1 for one at a time)
        servers["mlx_lm_one"] = launch(stock + ["--decode-concurrency", "1", "--prompt-concurrency", "1"], rtt,
                                       report("mlx_lm_one"), args.routing)
        mlxmoe += ["--memory-budget", budget]
    servers["batched"] = launch(mlxmoe + ["--max-batch", "16"], rtt, report("batched"), args.routing)
    servers["one"] = launch(mlxmoe + ["--max-batch", "1"], rtt, report("one"), args.routing)
    texts = {name: {} for name in servers}
    rows = []
    try:
        for s in servers.values():  # warm-up: compile, caches
            load_round(s, 2, 1, pool, args.max_tokens)
        for clients in clients_list:
            runs = {name: [] for name in servers}
            waits = {name: 0 for name in servers}
            stolen = {name: [] for name in servers}
            for r in range(args.rounds):
                names = list(servers)
                for name in names[r % len(names):] + names[:r % len(names)]:  # rotated each round
                    before, ticks = device_waits(servers[name]), cpu_ticks()
                    runs[name].append(load_round(servers[name], clients, args.requests, pool, args.max_tokens,
                                                 texts[name]))
                    stolen[name].append(stolen_share(ticks, cpu_ticks()))
                    waits[name] = None if before is None else waits[name] + device_waits(servers[name]) - before
            row = {"clients": clients, "rtt_us": rtt}
            for name, results in runs.items():
                row[f"{name}_rps"] = statistics.median(rps for rps, _, _, _ in results)
                row[f"{name}_tps"] = statistics.median(t for _, ts, _, _ in results for t in ts)
                rates = [d for _, _, _, d in results if d is not None]
                row[f"{name}_decode_tps"] = statistics.median(rates) if rates else None
                tokens = sum(n for _, _, n, _ in results)
                row[f"{name}_waits_per_token"] = None if waits[name] is None else waits[name] / tokens
                row[f"{name}_stolen"] = max(stolen[name]) if None not in stolen[name] else None
            row["vs_mlx_lm"] = row["batched_rps"] / row["mlx_lm_rps"]
            row["vs_one"] = row["batched_rps"] / row["one_rps"]
            row["decode_vs_one"] = (row["batched_decode_tps"] / row["one_decode_tps"]
                                    if row["batched_decode_tps"] and row["one_decode_tps"] else None)
            row["stock_gain"] = row["mlx_lm_rps"] / row["mlx_lm_one_rps"] if budget is not None else None
            rows.append(row)
            print_row(row, budget)
        # the budget with every round's clients batched: MLX's peak of the batching server's life
        stats = json.loads(servers["batched"].post("GET", "/v1/mlxmoe/stats")[2])
        peak = stats["peak_memory"] / stats["server"]["memory_budget"]
        print(f"batched server: MLX peak memory {stats['peak_memory'] / 2**20:.1f} MiB, {peak:.2f}x its budget "
              f"of {stats['server']['memory_budget'] / 2**20:.1f} MiB (target <= 1.05x)", flush=True)
        for row in rows:
            row["peak_over_budget"] = peak
    finally:
        stop(servers.values())
    same = same_answers(texts["batched"], texts["one"])
    print(f"greedy answers: batched the same as --max-batch 1 for {same[0]} of {same[1]} prompts"
          f"{'' if same[0] == same[1] else ' (DIFFERENT)'}", flush=True)
    for row in rows:
        row["same_answers"] = same
    return rows


def print_row(row, budget):
    at = f" at {budget}" if budget else ""
    at += f", round trip {row['rtt_us']:g} us" if row["rtt_us"] is not None else ""
    gain = (f"; stock mlx_lm.server batched / one at a time {row['stock_gain']:.2f}x "
            f"({row['mlx_lm_rps']:.2f} / {row['mlx_lm_one_rps']:.2f} req/s, every expert resident)"
            if budget is not None else "")
    waited = (f"; waits per generated token batched {row['batched_waits_per_token']:.1f}, "
              f"one {row['one_waits_per_token']:.1f}, mlx_lm.server {row['mlx_lm_waits_per_token']:.1f}"
              if row["rtt_us"] is not None else "")
    print(f"{row['clients']:>2} clients{at}: req/s batched {row['batched_rps']:.2f}, mlx_lm.server "
          f"{row['mlx_lm_rps']:.2f}, --max-batch 1 {row['one_rps']:.2f} (batched/mlx_lm "
          f"{row['vs_mlx_lm']:.2f}x, batched/one {row['vs_one']:.2f}x){gain}; tok/s per request batched "
          f"{row['batched_tps']:.1f}, one {row['one_tps']:.1f}{decoding(row)}{waited}{stolen_line(row)}", flush=True)


def stolen_line(row):
    """The most CPU time the hypervisor gave other guests in a round of each server (/proc/stat steal)."""
    shares = {name: row.get(f"{name}_stolen") for name in ("batched", "one", "mlx_lm")}
    if None in shares.values():
        return ""
    return "; CPU stolen in a round at most " + ", ".join(f"{n} {100 * v:.0f} %" for n, v in shares.items())


def decoding(row):
    """The row's generated tok/s while decoding (decode_rate), batched against one at a time."""
    if row["decode_vs_one"] is None:
        return ""
    return (f"; generated tok/s while decoding batched {row['batched_decode_tps']:.1f}, one "
            f"{row['one_decode_tps']:.1f} ({row['decode_vs_one']:.2f}x)")


def same_answers(batched, one):
    """(prompts answered alike, prompts both answered): each server's answers to a prompt
    (greedy, a set over rounds) must be one and the same."""
    both = [p for p in batched if p in one]
    return sum(len(batched[p]) == 1 and batched[p] == one[p] for p in both), len(both)


def reads_per_token(args, pool, clients_list):
    server = launch(["mlxmoe", "serve", "--model", args.model, "--max-batch", "16", "--memory-budget",
                     args.partial_budget, "--prefetch", "0"], None, None, args.routing)
    rows = []
    try:
        load_round(server, 1, 1, pool, args.max_tokens)  # warm-up

        def stats():
            return json.loads(server.post("GET", "/v1/mlxmoe/stats")[2])

        for clients in clients_list:
            before = stats()
            _, _, tokens, _ = load_round(server, clients, args.requests, pool, args.max_tokens)
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
    ap.add_argument("--prompt-chars", type=int, default=200,
                    help="the held-out prompts' length at most, characters (>= 40; ~1.2 a token). On this CPU a "
                         "prompt token of bench_host's checkpoint costs a sixth to a ninth of a decode step, stock "
                         "mlx-lm's too (MLX's CPU kernels), where on a GPU prompt tokens are processed many at "
                         "once: shorter prompts give prefill about the share of a request it has there")
    ap.add_argument("--partial-budget", default="46MB", help="the partial cache's --memory-budget (reads per token)")
    ap.add_argument("--partial-throughput", action="store_true",
                    help="Throughput at --partial-budget instead (batched against --max-batch 1), and its reads.")
    ap.add_argument("--stock-model", help="the checkpoint stock mlx_lm.server loads (default --model; for a "
                    "bundled --model, the folder it was converted from)")
    ap.add_argument("--rtt", help="emulated round trips to the device, us, comma-separated (bench/roundtrip.py "
                    "on every server's generation thread): throughput at each")
    ap.add_argument("--routing", help="[FORMAT:]FILE: every server's model routes as this recording of a real model "
                    "(bench/routed.py; the model's top-k must be its, and at most its layers), each request's rows "
                    "at their positions moved by their input tokens, so that distinct requests route as distinct "
                    "steps of the real model")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "batch.json"))
    args = ap.parse_args()
    inputs = {"--model": model_folder(args.model)}
    if args.stock_model:
        inputs["--stock-model"] = model_folder(args.stock_model)
    if args.routing:
        inputs["--routing"] = routed.recording(args.routing)[1]
    check_outputs({"--out": args.out}, inputs)
    clients = [int(c) for c in args.clients.split(",")]
    if args.prompt_chars < 40:  # (heldout.prompts keeps pieces of 40 characters or more)
        ap.error(f"--prompt-chars {args.prompt_chars}: at least 40")
    pool = [p for lang in ("en", "it", "de", "fr", "es") for p in prompts(lang, 8, max_chars=args.prompt_chars)]
    budget = args.partial_budget if args.partial_throughput else None
    rtts = [None] if args.rtt is None else [float(r) for r in args.rtt.split(",")]
    results = {"args": vars(args), "throughput": [row for rtt in rtts for row in throughput(args, pool, clients,
                                                                                          budget, rtt)],
               "reads": reads_per_token(args, pool, clients)}
    write_json(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
