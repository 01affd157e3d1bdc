"""`mlxmoe serve` against `mlx_lm.server` on the same checkpoint, in one run:

1. throughput: requests/s and median time to first token with 1, 4 and 8 concurrent
   streaming chat clients (each its own held-out prompts, greedy, --max-tokens each), mlxmoe
   with every expert resident against mlx_lm.server (which batches concurrent requests;
   mlxmoe serves one at a time; neither keeps KV caches across requests), rounds alternated,
   medians and the ratio;
2. profiles: with profiles/italian.json and profiles/english.json in a folder, the share of
   held-out Italian and English prompts (bench/data/heldout, not the prompts the profiles were
   recorded from) whose prefill picks their language's profile, and the mean per-request
   expert hit rate over the prefill and the first 64 tokens at a cache of --cache-experts,
   Italian and English requests alternating: no profiles, matched profiles, and the right
   profile named in each request.

    python bench/bench_server.py [--model DIR] [--rounds 3] [--only throughput|profiles]
"""

import argparse
import http.client
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from heldout import prompts  # noqa: E402
from system import check_outputs, model_folder, write_json  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on 127.0.0.1, ready once /health answers (bounded wait). Where it exits
    or does not answer in time, the error ends with the last lines it wrote to stderr."""

    def __init__(self, argv, timeout=120, env=None):
        self.port = free_port()
        self.errors = tempfile.TemporaryFile()  # (a file, not a pipe: a full pipe would stall the server)
        self.proc = subprocess.Popen([*argv, "--port", str(self.port)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=self.errors, env=env)
        tic = time.monotonic()
        while time.monotonic() - tic < timeout and self.proc.poll() is None:
            try:
                if self.post("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        exited = self.proc.poll()
        self.stop()
        why = f"exited with status {exited}" if exited is not None else f"did not start in {timeout} s"
        raise RuntimeError(f"{argv[:3]} {why}; its stderr ended with:\n{self.stderr_tail()}")

    def stderr_tail(self, lines=20):
        self.errors.seek(0)
        return "\n".join(self.errors.read().decode(errors="replace").splitlines()[-lines:])

    def post(self, method, path, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request(method, path, body=None if body is None else json.dumps(body))
        r = conn.getresponse()
        out = r.status, dict(r.getheaders()), r.read()
        conn.close()
        return out

    def stream(self, prompt, max_tokens):
        """(seconds to the first content chunk, seconds in all) of one streaming chat request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        tic = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=json.dumps({
            "model": "default_model", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}))
        r = conn.getresponse()
        first = None
        for line in r:
            if first is None and line.startswith(b"data: {") and b'"content"' in line:
                first = time.perf_counter() - tic
            if line.startswith(b"data: [DONE]"):
                break
        conn.close()
        return first, time.perf_counter() - tic

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def load_round(server, clients, requests, pool, max_tokens):
    """`clients` threads, each `requests` streaming requests in turn: (requests/s, TTFTs)."""
    ttfts, errors = [], []

    def client(i):
        try:
            for j in range(requests):
                first, _ = server.stream(pool[(i * requests + j) % len(pool)], max_tokens)
                ttfts.append(first)
        except Exception as e:  # reported: a failed request is not a fast one
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - tic
    if errors or any(t is None for t in ttfts):
        raise RuntimeError(f"failed requests: {errors[:3]}")
    return clients * requests / wall, ttfts


def throughput(args):
    pool = [p for lang in ("en", "it", "de", "fr", "es") for p in prompts(lang, 8, max_chars=200)]
    mlxmoe = Server([sys.executable, "-m", "mlxmoe", "serve", "--model", args.model])
    # no KV caches kept across requests on either side (mlxmoe serve's default; mlx-lm's
    # would skip the prefill of prompts repeated across rounds)
    stock = Server([sys.executable, "-m", "mlx_lm", "server", "--model", args.model, "--prompt-cache-size", "0"])
    servers = {"mlxmoe": mlxmoe, "mlx_lm": stock}
    try:
        for s in servers.values():  # warm-up: compile, caches
            load_round(s, 1, 2, pool, args.max_tokens)
        rows = []
        for clients in (1, 4, 8):
            runs = {name: [] for name in servers}
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for name in order:
                    runs[name].append(load_round(servers[name], clients, args.requests, pool, args.max_tokens))
            row = {"clients": clients}
            for name, results in runs.items():
                row[f"{name}_rps"] = statistics.median(rps for rps, _ in results)
                row[f"{name}_ttft_ms"] = 1000 * statistics.median(t for _, ts in results for t in ts)
            row["rps_ratio"] = row["mlxmoe_rps"] / row["mlx_lm_rps"]
            row["ttft_ratio"] = row["mlxmoe_ttft_ms"] / row["mlx_lm_ttft_ms"]
            rows.append(row)
            print(f"{clients} clients: mlxmoe {row['mlxmoe_rps']:.2f} req/s, TTFT {row['mlxmoe_ttft_ms']:.0f} ms; "
                  f"mlx_lm.server {row['mlx_lm_rps']:.2f} req/s, TTFT {row['mlx_lm_ttft_ms']:.0f} ms; "
                  f"ratio req/s {row['rps_ratio']:.2f}x, TTFT {row['ttft_ratio']:.2f}x", flush=True)
        return rows
    finally:
        for s in servers.values():
            s.stop()


def profile_matching(args):
    folder = Path(tempfile.mkdtemp(prefix="mlxmoe-profiles-"))  # copies in a temp folder of our own
    for name in ("italian", "english"):
        shutil.copy(ROOT / "profiles" / f"{name}.json", folder)
    truth = {"it": "italian", "en": "english"}
    sets = {lang: prompts(lang, args.prompts) for lang in truth}
    sequence = [(lang, p) for pair in zip(sets["it"], sets["en"]) for lang, p in zip(truth, pair)]
    base = [sys.executable, "-m", "mlxmoe", "serve", "--model", args.model, "--cache-experts", str(args.cache_experts)]
    out = {}
    try:
        for mode in args.modes.split(","):
            server = Server(base + ([] if mode == "none" else ["--profiles", str(folder)]))
            try:
                hits, right = {"it": [], "en": []}, 0
                for lang, prompt in sequence:
                    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 64}
                    if mode == "named":
                        body["mlxmoe"] = {"profile": truth[lang]}
                    status, headers, data = server.post("POST", "/v1/chat/completions", body)
                    assert status == 200, data
                    usage = json.loads(data)["usage"]["mlxmoe"]
                    hits[lang].append(usage["expert_hit_rate"])
                    right += headers.get("X-Mlxmoe-Profile") == truth[lang]
            finally:
                server.stop()
            out[mode] = {lang: statistics.mean(h) for lang, h in hits.items()}
            out[mode]["all"] = statistics.mean(h for v in hits.values() for h in v)
            if mode == "matched":
                out["accuracy"] = right / len(sequence)
            print(f"{mode}: hit rate {100 * out[mode]['all']:.1f}% (Italian {100 * out[mode]['it']:.1f}%, "
                  f"English {100 * out[mode]['en']:.1f}%)"
                  + (f"; profile picked right for {right}/{len(sequence)} prompts" if mode == "matched" else ""),
                  flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "mlxmoe" / "demo"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4, help="requests per client per round")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=20, help="held-out prompts per language (profiles)")
    ap.add_argument("--cache-experts", type=int, default=64, help="cache size for the profiles part")
    ap.add_argument("--modes", default="none,matched,named", help="profiles part: which of none,matched,named")
    ap.add_argument("--only", choices=["throughput", "profiles"])
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "server.json"))
    args = ap.parse_args()
    check_outputs({"--out": args.out}, {"--model": model_folder(args.model)})
    results = {}
    if args.only != "profiles":
        results["throughput"] = throughput(args)
    if args.only != "throughput":
        results["profiles"] = profile_matching(args)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
