"""Where a decode token's host time goes on the decode thread, by section, mlxmoe against stock
mlx-lm in one process: each section's self CPU time (time.thread_time, the sections called
within it taken out) and calls per token. The sections: the __call__ of every module class of
the model (mlx-lm's and mlxmoe's, a verified layer's under mlx-lm's class name), mx.eval and
mx.async_eval (MLX's own host work for what it queues, and a wait for the device), and the
functions of the verified path and of the cache that run at a check or a miss (SECTIONS).
On bench_host.py's host-bound checkpoint (built there), routed as a recording where --routing;
every call of a section costs ~1 us more for its wrapper, so read shares and differences, not
totals (bench_host.py times the whole). Stock, mlxmoe, mlxmoe, stock after warming both, each
round; mlxmoe's verified steps held on (its switch does not weigh them) unless --weigh.

    python bench/host_sections.py --routing ../shared/data/real-routing/bigmoeonedge/qwen.route.csv \\
        --checkpoint BUNDLED --stock-checkpoint STACKED --cache-experts 3425
"""

import argparse
import collections
import importlib
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import bench_host  # noqa: E402

# (module, class or None for a function of the module, attribute) of mlxmoe
SECTIONS = [("caching.verify", "Verifier", "_check"), ("caching.verify", "Verifier", "experts"),
            ("caching.verify", "Verifier", "_decoder_call"), ("caching.verify", "KeptAttention", "call"),
            ("caching.verify", "PassRouting", "wait"), ("caching.verify", "PassRouting", "rows"),
            ("caching.verify", "PassRouting", "dists_of"), ("caching.verify", "PassRouting", "pack"),
            ("caching.verify", "PassRouting", "clear"), ("caching.verify", "SlotTables", "first_miss"),
            ("caching.verify", "SlotTables", "read"), ("caching.verify", "SlotTables", "build"),
            ("caching.verify", "SlotTables", "update"), ("caching.verify", None, "tell_hits"),
            ("caching.cache", "Residency", "access"), ("caching.cache", "Residency", "catch_up"),
            ("caching.cache", "Residency", "victim"), ("caching.cache", "Residency", "claim"),
            ("caching.cache", "SlotPools", "read_keys"), ("caching.cache", "ExpertCache", "read_demand")]


class Sections:
    """Self CPU time and calls per section on the thread that made it, into the `config` in turn."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.config = None
        self.seconds = collections.defaultdict(collections.Counter)
        self.calls = collections.defaultdict(collections.Counter)
        self.stack = []  # [name, start, seconds of the sections within]

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = vars(owner).get(attr) or getattr(owner, attr)
        if getattr(fn, "_section", None):
            return

        def timed(*args, **kwargs):
            if threading.get_ident() != self.thread or self.config is None:
                return fn(*args, **kwargs)
            self.stack.append([name, time.thread_time(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                _, start, within = self.stack.pop()
                spent = time.thread_time() - start
                self.seconds[self.config][name] += spent - within
                self.calls[self.config][name] += 1
                if self.stack:
                    self.stack[-1][2] += spent

        timed._section = True
        setattr(owner, attr, timed)

    def wrap_modules(self, model) -> None:
        """The call of each module class of `model`: its mlx-lm (or MLX) class's where it has
        one, else its mlxmoe class's; what the subclasses made for one instance (mlxmoe's
        verified, recorded and tapped layers, the bench's routed ones) do around it falls in
        the section that calls them."""
        for _, module in model.named_modules():
            cls = type(module)
            named = next((c for c in cls.__mro__ if c.__module__.split(".")[0] in ("mlx", "mlx_lm")
                          and c.__name__ != "Module"), None) or next(
                (c for c in cls.__mro__ if c.__module__.startswith("mlxmoe") and not c.__name__.startswith("Verified")),
                cls)  # (a module class of none of these: its own)
            self.wrap(named, "__call__", named.__name__)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=bench_host.DEFAULT_CHECKPOINT,
                        help="bench_host.py's (built there if missing: run it once).")
    parser.add_argument("--stock-checkpoint", type=Path, default=None,
                        help="Where stock mlx-lm loads the same weights from (default: --checkpoint).")
    parser.add_argument("--cache-experts", type=int, required=True, help="mlxmoe's cache size, experts.")
    parser.add_argument("--routing", default=None, help="[FORMAT:]FILE: route as this recording did (bench_host.py).")
    parser.add_argument("--tokens", type=int, default=64, help="Greedy tokens per generation.")
    parser.add_argument("--rounds", type=int, default=2, help="Rounds of stock, mlxmoe, mlxmoe, stock.")
    parser.add_argument("--weigh", action="store_true", help="Let the verified mode's switch weigh its steps.")
    parser.add_argument("--top", type=int, default=30, help="Sections printed, largest difference first.")
    args = parser.parse_args()
    args.prompt, args.no_repeat, args.load_kwargs, args.timeout, args.one = (
        bench_host.DEFAULT_PROMPT, 32, "{}", 1800, "sections")
    bench_host.use_routing(args)  # (the checkpoint's counts: the recording's)
    for path in (args.checkpoint, args.stock_checkpoint):
        if path is not None and not bench_host.checkpoint_ready(path):
            sys.exit(f"no host-bound checkpoint of these counts at {path} (bench_host.py builds its own: run it once)")
    import mlx.core as mx

    stock = bench_host.open_stock(args, args.stock_checkpoint or args.checkpoint)
    args.slots = args.cache_experts
    model, tokenizer, generate, cache = bench_host.open_model(args)
    if cache.verifier is not None and not args.weigh:
        cache.verifier.switch.weigh = lambda *a: False
    sections = Sections()
    for name in ("eval", "async_eval"):
        sections.wrap(mx, name, f"mx.{name}")
    for module, cls, attr in SECTIONS:
        owner = importlib.import_module(f"mlxmoe.{module}")
        sections.wrap(owner if cls is None else getattr(owner, cls), attr, f"{cls or module.split('.')[-1]}.{attr}")
    for m in (stock[0], model):
        sections.wrap_modules(m)
    runs = {"stock": lambda: bench_host.timed_generation(stock[2], stock[0], stock[1], args),
            "mlxmoe": lambda: bench_host.timed_generation(generate, model, tokenizer, args, cache=cache)}
    for run in runs.values():  # (warm: the cache, the switch, MLX's compiled kernels)
        run(), run()
    tokens, host, wanted, before = collections.Counter(), collections.Counter(), {}, cache.stats()
    for _ in range(args.rounds):
        for config in ("stock", "mlxmoe", "mlxmoe", "stock"):
            sections.config, start = config, time.thread_time()
            out = runs[config]()
            host[config] += time.thread_time() - start
            sections.config = None
            tokens[config] += len(out["tokens"])
            wanted.setdefault(config, out["tokens"])
            if out["tokens"] != wanted[config]:
                sys.exit(f"{config}'s tokens changed between rounds")
    s = {k: v - before[k] for k, v in cache.stats().items() if k in ("hits", "misses", "replays", "verified_tokens")}
    print(f"{args.checkpoint}, {args.cache_experts} experts cached, {args.rounds} rounds of {args.tokens} tokens; "
          f"tokens identical: {'yes' if wanted['stock'] == wanted['mlxmoe'] else 'NO'}; mlxmoe's hit rate "
          f"{s['hits'] / max(s['hits'] + s['misses'], 1):.1%}, {s['replays'] / tokens['mlxmoe']:.2f} replays a token, "
          f"{s['verified_tokens'] / tokens['mlxmoe']:.0%} of its tokens verified")
    per = {c: {k: 1e3 * v / tokens[c] for k, v in sections.seconds[c].items()} for c in ("stock", "mlxmoe")}
    calls = {c: {k: v / tokens[c] for k, v in sections.calls[c].items()} for c in ("stock", "mlxmoe")}
    total = {c: 1e3 * host[c] / tokens[c] for c in ("stock", "mlxmoe")}
    print(f"decode-thread host time: stock {total['stock']:.2f} ms a token, mlxmoe {total['mlxmoe']:.2f} "
          f"({total['mlxmoe'] / total['stock']:.2f}x; the wrappers' cost included in both)")
    names = sorted(set(per["stock"]) | set(per["mlxmoe"]),
                   key=lambda k: -(per["mlxmoe"].get(k, 0) - per["stock"].get(k, 0)))
    print(f"{'section (self time)':34s} {'stock ms':>9s} {'calls':>7s} {'mlxmoe ms':>10s} {'calls':>7s} {'more ms':>8s}")
    for k in names[:args.top]:
        a, b = per["stock"].get(k, 0.0), per["mlxmoe"].get(k, 0.0)
        print(f"{k:34s} {a:9.3f} {calls['stock'].get(k, 0):7.2f} {b:10.3f} {calls['mlxmoe'].get(k, 0):7.2f} {b - a:8.3f}")
    rest = {c: total[c] - sum(per[c].values()) for c in total}
    print(f"{'(outside every section)':34s} {rest['stock']:9.3f} {'':7s} {rest['mlxmoe']:10.3f} {'':7s} "
          f"{rest['mlxmoe'] - rest['stock']:8.3f}")


if __name__ == "__main__":
    main()
