"""Host work per decode token counted in instructions, not timed: on a shared 2-core VM a
token's time moves by 1.3x between runs (stock mlx-lm's host-bound token took 24-35 ms in
one hour), so a few percent of host work cannot be seen in seconds. Each configuration runs
under valgrind's callgrind twice, generating --short and --long tokens after a warm-up
generation of --long tokens with the same prompt (greedy: the measured generation repeats
the warm-up's routing, so a cache that held it hits); the difference over the extra tokens
is the instructions a decode token costs, per thread: the decode thread's (the host work)
and MLX's CPU stream's (the device work here). Counts repeat within ~3 % (the threads
interleave differently under valgrind); decisions timed by the runtime (verified or
per-layer steps, predicting) are not those of a real run, so mlxmoe runs with its verified
mode held on (`verify` in the output), or with `N:layer` the per-layer path held on and no
prefetch. With --routing, every model routes as a recording of a real model does (as in
bench_host.py: the checkpoint must have the recording's counts, as bench_host.py builds it), so
that a cache size hits as it does there. Needs Debian's `valgrind`; ~3 minutes a configuration.

    python bench/host_instructions.py [--configs stock,3000,957,465:layer] [--checkpoint BUNDLED --stock-checkpoint STACKED]
        [--routing [FORMAT:]FILE]
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = "/tmp/mlxmoe-bench"


def worker(args):
    """One generation in this process (under valgrind): warm-up, then args.tokens tokens."""
    import resource
    resource.setrlimit = lambda *a, **k: None  # (mlx-lm raises the fd limit; valgrind forbids it)
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    import mlx.core as mx

    from bench_runtime import DEFAULT_PROMPT, no_repeat
    if args.config == "stock":
        import mlx_lm

        from mlxmoe import backend
        model, tokenizer = mlx_lm.load(args.stock_checkpoint)
        backend.detect().apply_dtype_policy(model)
        mx.eval(model.parameters())
        generate = mlx_lm.stream_generate
    else:
        import mlxmoe
        experts, _, path = args.config.partition(":")
        model, tokenizer = mlxmoe.load(args.checkpoint, cache_experts=int(experts),
                                       **({"prefetch": 0} if path == "layer" else {}))
        verifier = model.expert_cache.verifier
        if verifier is not None and path == "layer":  # the per-layer path throughout
            verifier.switch.step = lambda: False
        elif verifier is not None:  # (none where every expert is cached)
            verifier.switch.weigh = lambda *a: False  # verified steps throughout
        generate = mlxmoe.stream_generate
    if args.routing:
        import routed

        meta, logits, first_decode = routed.read_or_exit(args.routing)
        routed.follow(model, logits, first_decode, len(tokenizer.encode(DEFAULT_PROMPT)))

    def run(n):
        return [r.token for r in generate(model, tokenizer, DEFAULT_PROMPT, max_tokens=n,
                                          logits_processors=[no_repeat(32)])]
    run(args.long)
    tokens = run(args.tokens)
    info = {"tokens": tokens}
    if args.config != "stock":
        s = model.expert_cache.stats()
        info.update(replays=s["replays"], verify=s["verify"]["on"])
    print("RESULT " + json.dumps(info))


def thread_totals(prefix):
    """{thread number: instructions} of callgrind's files `prefix`.<pid>-<thread>."""
    out = {}
    for path in glob.glob(prefix + ".*-*"):
        with open(path) as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    out[int(path.rsplit("-", 1)[1])] = int(line.split()[1])
                    break
    return out


def measure(config, args, scratch):
    """(decode-thread, busiest other thread) instructions a token, and the runs' stats."""
    totals, infos = {}, {}
    for n in (args.short, args.long):
        prefix = os.path.join(scratch, f"{config}.{n}")
        cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={prefix}.%p",
               sys.executable, __file__, "--worker", config, "--tokens", str(n), "--long", str(args.long),
               "--checkpoint", args.checkpoint, "--stock-checkpoint", args.stock_checkpoint]
        cmd += ["--routing", args.routing] if args.routing else []
        out = subprocess.run(cmd, capture_output=True, text=True)
        result = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode or not result:
            raise SystemExit(f"{config} ({n} tokens) failed:\n{out.stderr[-2000:]}")
        infos[n] = json.loads(result[-1][7:])
        totals[n] = thread_totals(prefix)
    extra = args.long - args.short
    per = {t: (totals[args.long].get(t, 0) - totals[args.short].get(t, 0)) / extra for t in totals[args.long]}
    main = per.pop(1)
    return main, max(per.values(), default=0.0), infos


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="stock,3000,957",
                    help="stock (mlx-lm on --stock-checkpoint) and mlxmoe cache sizes in experts, comma-separated; "
                         "N:layer holds the per-layer path (no verified steps) without prefetch")
    ap.add_argument("--checkpoint", default=f"{BENCH}/host-bound-qwen3-48L-bundled")
    ap.add_argument("--stock-checkpoint", default=f"{BENCH}/host-bound-qwen3-48L")
    ap.add_argument("--short", type=int, default=8, help="tokens of the shorter measured generation")
    ap.add_argument("--long", type=int, default=40, help="tokens of the longer one (and of the warm-up)")
    ap.add_argument("--routing", help="[FORMAT:]FILE: the models route as this recording of a real model "
                                      "(bench/routed.py; e.g. ../shared/data/real-routing/bigmoeonedge/qwen.route.csv)")
    ap.add_argument("--worker", dest="config", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.config is not None:
        return worker(args)
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind (Debian: apt install valgrind)")
    for path in (args.checkpoint, args.stock_checkpoint):
        if not Path(path, "config.json").is_file():
            raise SystemExit(f"no checkpoint at {path}: make it with python bench/bench_host.py first")
    with tempfile.TemporaryDirectory(prefix="mlxmoe-callgrind-") as scratch:
        rows, base = [], None
        for config in args.configs.split(","):
            main_t, device_t, infos = measure(config.strip(), args, scratch)
            base = main_t if config.strip() == "stock" and base is None else base
            long = infos[args.long]
            note = "" if "replays" not in long else (
                f"verify {'on' if long['verify'] else 'off'}, "
                f"replays {(long['replays'] - infos[args.short]['replays']) / (args.long - args.short):.2f} a token")
            rows.append((config, main_t, device_t, note, long["tokens"]))
            print(f"{config:>9}: decode thread {main_t / 1e6:7.2f} M instructions a token"
                  f"{'' if base is None else f' ({main_t / base:.2f}x stock)'}, MLX's stream {device_t / 1e6:6.2f} M; {note}",
                  flush=True)
        same = len({tuple(r[4]) for r in rows}) == 1
        print(f"tokens identical across configurations: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
