"""mlxmoe.generate shared by threads: one generation at a time per model, each thread's
text equal to its solo run; unguarded, a thread gets wrong text, or 'There is no
Stream(cpu, 3) in current thread' from the deferred host work of another thread's tokens."""

import threading
from pathlib import Path

import pytest

import mlxmoe
from mlxmoe.api import stream_generate

DEMO = Path(mlxmoe.__file__).parent / "demo"
PROMPTS = ["The cat sat on", "Il gatto è sul", "Le chat est", "Der Hund"]


def in_threads(fn, args):
    out = [None] * len(args)

    def run(i):
        try:
            out[i] = fn(*args[i])
        except Exception as e:  # the caller compares: an error is a wrong answer
            out[i] = repr(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return out


@pytest.mark.parametrize("cache_experts", [None, 20])  # every expert resident; a cache that evicts
def test_threads_get_their_solo_text(cache_experts):
    kw = {} if cache_experts is None else {"cache_experts": cache_experts}
    model, tok = mlxmoe.load(str(DEMO), **kw)
    solo = [mlxmoe.generate(model, tok, p, max_tokens=32) for p in PROMPTS]
    for _ in range(2):
        got = in_threads(lambda p: mlxmoe.generate(model, tok, p, max_tokens=32), [(p,) for p in PROMPTS])
        assert got == solo


def test_a_stream_closed_early_frees_the_model_for_other_threads():
    model, tok = mlxmoe.load(str(DEMO), cache_experts=20)
    solo = mlxmoe.generate(model, tok, PROMPTS[1], max_tokens=32)

    def partial(p):
        gen = stream_generate(model, tok, p, max_tokens=32)
        text = "".join(next(gen).text for _ in range(5))
        gen.close()  # releases the lock; the next generation starts clean
        return text

    assert in_threads(partial, [(PROMPTS[0],)])[0]
    assert in_threads(lambda p: mlxmoe.generate(model, tok, p, max_tokens=32), [(PROMPTS[1],)]) == [solo]
    # a thread holding an open stream makes another wait, not interleave
    gen = stream_generate(model, tok, PROMPTS[0], max_tokens=32)
    next(gen)
    waiter = threading.Thread(target=lambda: mlxmoe.generate(model, tok, PROMPTS[1], max_tokens=32))
    waiter.start()
    waiter.join(timeout=1.0)
    assert waiter.is_alive()
    gen.close()
    waiter.join(timeout=60)
    assert not waiter.is_alive()



def test_streaming_lowers_the_switch_interval_until_the_last_streaming_model_closes():
    """A read thread waits for the GIL after each system call, and a thread busy in Python
    hands it over once a switch interval (bench/read_contention.py: 50x a read's time at
    5 ms): a streaming model lowers the interval while it is open, a resident one leaves it.
    In a fresh interpreter (a model of another test, never closed, would hold it lowered)."""
    import subprocess
    import sys

    script = f"""
import sys
import mlxmoe
from mlxmoe.caching.cache import READ_SWITCH_INTERVAL as low
before = sys.getswitchinterval()
assert before > low, before  # (Python's default, 5 ms)
resident, _ = mlxmoe.load({str(DEMO)!r})
assert sys.getswitchinterval() == before
first, _ = mlxmoe.load({str(DEMO)!r}, cache_experts=20)
second, _ = mlxmoe.load({str(DEMO)!r}, cache_experts=20)
assert abs(sys.getswitchinterval() - low) < 1e-9, sys.getswitchinterval()
first.expert_cache.close()
first.expert_cache.close()  # (closing again changes nothing)
assert abs(sys.getswitchinterval() - low) < 1e-9, "the second still streams"
second.expert_cache.close()
resident.expert_cache.close()
assert sys.getswitchinterval() == before, sys.getswitchinterval()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
