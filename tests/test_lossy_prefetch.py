"""The prefetcher under the lossy modes (lossy.Lossy.guesses): its lookahead ranks the next
layer's experts as the biased router will, and never reads a guess that trimming would skip;
with the modes off it is untouched."""

import numpy as np
import pytest

import mlxmoe
from mlxmoe.caching.lossy import Lossy
from mlxmoe.caching.prefetch import Prefetcher, ReadBar, Worth

PROMPT = "The quick brown fox jumps over the lazy dog. Il gatto"


def softmax(z):
    z = np.exp(z - z.max())
    return z / z.sum()


@pytest.mark.parametrize("kw", [{"cache_bias": 1.5}, {"trim": 0.3}, {"trim_mass": 0.6},
                                {"cache_bias": 0.75, "trim": 0.2, "trim_mass": 0.8}])
def test_guesses_rank_as_the_biased_router_and_skip_what_the_layer_would(kw):
    rng = np.random.default_rng(1)
    lossy = Lossy("topk", **kw)
    bias = kw.get("cache_bias", 0.0)
    E, k, layer = 16, 4, 3
    for _ in range(300):
        logits = rng.normal(size=E) * 2
        resident = set(rng.choice(E, size=int(rng.integers(0, E + 1)), replace=False).tolist())
        slot_of = {(layer, e): 0 for e in resident} | {(layer + 1, e): 0 for e in range(E)}  # other layers: no matter
        mask = np.array([float(e in resident) for e in range(E)])
        ranked, skip = lossy.guesses(softmax(logits).astype(np.float32), layer, slot_of, k)
        biased = 0 < len(resident) < E and bias
        np.testing.assert_allclose(ranked, softmax(logits + bias * mask) if biased else softmax(logits), rtol=1e-5)
        row = np.argsort(-(logits + bias * mask), kind="stable")[:k].tolist()
        keep, _, _ = lossy.step(logits, row, [e in resident for e in row], mask if biased else None)
        assert [e not in skip for e in row] == keep  # the predicted top k: as the layer would keep them
        weakest = min(row, key=lambda e: logits[e])
        for e in set(range(E)) - set(row):  # another expert: as if routed in place of the top k's weakest
            other = [x for x in row if x != weakest] + [e]
            kept, _, _ = lossy.step(logits, other, [x in resident for x in other], None)
            assert (e in skip) == (not kept[-1]), e
        if not (kw.get("trim") or kw.get("trim_mass")):
            assert skip == ()


def spy_prefetcher(monkeypatch):
    """Record each submit's `skip` with the keys it queued for reading, and each guesses()."""
    submits, guessed = [], []
    submit, queue, guesses = Prefetcher.submit, Prefetcher.queue, Lossy.guesses

    def recording_submit(self, *args, **kw):
        submits.append({"skip": set(kw.get("skip", args[7] if len(args) > 7 else ())), "queued": []})
        return submit(self, *args, **kw)

    def recording_queue(self, keys, *args, **kw):
        if submits:
            submits[-1]["queued"] += list(keys)
        return queue(self, keys, *args, **kw)

    def recording_guesses(self, probs, layer, slot_of, k):
        out = guesses(self, probs, layer, slot_of, k)
        guessed.append((probs.copy(), {e for (l, e) in list(slot_of) if l == layer}, out))
        return out

    monkeypatch.setattr(Prefetcher, "submit", recording_submit)
    monkeypatch.setattr(Prefetcher, "queue", recording_queue)
    monkeypatch.setattr(Lossy, "guesses", recording_guesses)
    return submits, guessed


def generate(path, tokens=24, **kw):
    model, tokenizer = mlxmoe.load(str(path), prefetch=1, cache_experts=6, **kw)
    out = [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=tokens)]
    runtime = model.expert_runtime
    stats = model.expert_cache.stats()
    runtime.close()
    return out, stats, runtime


@pytest.mark.parametrize("kw", [{"trim": 0.45}, {"trim_mass": 0.55}, {"trim": 0.45, "cache_bias": 1.0}])
def test_prefetch_never_reads_a_guess_trimming_would_skip(checkpoint, monkeypatch, kw):
    submits, guessed = spy_prefetcher(monkeypatch)
    # guesses read however this machine's load times reads and layers (else a loaded one may read none)
    monkeypatch.setattr(Worth, "WARMUP", 10**9)  # predicting never paused
    monkeypatch.setattr(ReadBar, "__call__", lambda self, steps: 0.0)  # every guess clears the bar
    _, stats, runtime = generate(checkpoint("mixtral"), **kw)
    assert runtime.prefetcher.lossy is runtime.lossy is not None
    assert guessed and any(s["skip"] for s in submits), "no guess would have been skipped: the test tests nothing"
    assert sum(len(s["queued"]) for s in submits) > 0, "nothing was prefetched: the test tests nothing"
    for s in submits:
        assert not {e for _, e in s["queued"]} & s["skip"], "a guess trimming skips was queued for reading"
    # every byte read is an expert read whole, on demand or in the background
    expert = runtime.cache.store.expert_file_bytes()
    assert stats["bytes_read"] == (stats["loads_demand"] + stats["loads_prefetched"]) * expert


def test_prefetch_ranks_by_the_biased_router(checkpoint, monkeypatch):
    _, guessed = spy_prefetcher(monkeypatch)
    generate(checkpoint("qwen3_moe"), cache_bias=2.0)
    moved = 0
    for probs, resident, (ranked, skip) in guessed:
        assert skip == ()
        mask = np.array([float(e in resident) for e in range(len(probs))])
        if 0 < mask.sum() < len(mask):
            want = probs * np.exp(2.0 * mask)
            np.testing.assert_allclose(ranked, want / want.sum(), rtol=1e-5)
            moved += np.argsort(-ranked)[0] != np.argsort(-probs)[0]
    assert moved > 0, "the bias never changed a guess: the test tests nothing"


def test_exact_prefetch_is_untouched(checkpoint, monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("Lossy.guesses called in exact mode")

    monkeypatch.setattr(Lossy, "guesses", refuse)
    # guesses read however this machine's load times reads and layers (else a loaded one may read none)
    monkeypatch.setattr(Worth, "WARMUP", 10**9)  # predicting never paused
    monkeypatch.setattr(ReadBar, "__call__", lambda self, steps: 0.0)  # every guess clears the bar
    path = checkpoint("mixtral")
    tokens, stats, runtime = generate(path)
    assert runtime.lossy is None and runtime.prefetcher.lossy is None and stats["loads_prefetched"] > 0
