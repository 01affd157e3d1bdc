"""Lossy modes (lossy.py): top-k trimming skips exactly the non-resident experts below the
threshold and never reads them; cache-aware routing changes the chosen experts only toward
resident ones and keeps the model's own weights over them; both off add nothing; models
whose routing cannot be reweighted are refused by name."""

import numpy as np
import pytest

import mlxmoe
from mlxmoe.caching import cache as cache_module
from mlxmoe.caching.cache import ExpertCache
from mlxmoe.errors import MlxmoeError
from mlxmoe.caching.lossy import Lossy

PROMPT = "The quick brown fox jumps over the lazy dog. Il gatto"
TOKENS = 16


def softmax(z):
    z = np.exp(z - z.max())
    return z / z.sum()


def weights(rule, logits, row):
    """The weights mlx-lm's block gives the routed experts `row` from `logits`."""
    return softmax(logits[row]) if rule == "topk" else softmax(logits)[row]


def want_keep(share, resident, trim=0.0, trim_mass=0.0):
    """The experts trimming keeps, by the rule as stated: resident ones, and the others with at
    least `trim` of the weight and (trim_mass) among the top ones, best first, until
    trim_mass of it is covered; the strongest where none would be."""
    covered, within = 0.0, {}
    for i in sorted(range(len(share)), key=lambda i: -share[i]):
        within[i] = not trim_mass or covered < trim_mass
        covered += share[i]
    want = [bool(r or (s >= trim and within[i])) for i, (r, s) in enumerate(zip(resident, share))]
    if not any(want):
        want[int(np.argmax(share))] = True
    return want


@pytest.mark.parametrize("rule", ["topk", "softmax"])
def test_step_scales_give_the_models_weights_over_the_kept_experts(rule):
    rng = np.random.default_rng(0)
    for _ in range(200):
        logits = rng.normal(size=16) * 2
        row = rng.choice(16, size=4, replace=False).tolist()
        resident = (rng.random(4) < 0.5).tolist()
        mask = (rng.random(16) < 0.5).astype(np.float64)
        mask[row] = np.array(resident, dtype=np.float64)  # the routed experts' residency agrees
        lossy = Lossy(rule, trim=0.3, cache_bias=1.5, trim_mass=0.7)
        keep, scales, _ = lossy.step(logits, row, resident, mask)
        w = weights(rule, logits, row)
        assert keep == want_keep(w / w.sum(), resident, 0.3, 0.7)
        wanted = np.where(keep, w, 0.0)
        if rule == "topk":
            wanted /= wanted.sum()
        applied = weights(rule, logits + 1.5 * mask, row)  # what the block applies: the biased logits'
        np.testing.assert_allclose(applied * np.array(scales), wanted, rtol=1e-9, atol=1e-12)


def test_step_changes_nothing_where_all_are_resident_unbiased():
    keep, scales, biased = Lossy("topk", trim=0.9).step(np.array([0.0, 1.0, 2.0]), [2, 1], [True, True], None)
    assert keep == [True, True] and scales is None and biased == 0


def spy(monkeypatch):
    """Record each Lossy.step (inputs and outputs) and each demand read [(layer, [experts])]: on the
    decode thread (read_demand) or asked of the disk at once (read_later)."""
    steps, reads = [], []
    step, read, later = Lossy.step, ExpertCache.read_demand, cache_module.read_later

    def recording_step(self, logits, row, resident, mask):
        out = step(self, logits, row, resident, mask)
        steps.append((logits.copy(), list(row), list(resident), None if mask is None else mask.copy(), out))
        reads.append(("step", len(steps) - 1))
        return out

    def recording_read(self, layer, missed):
        reads.append((layer, [e for e, _ in missed]))
        return read(self, layer, missed)

    def recording_later(cache, layer, missed, taken):
        reads.append((layer, [e for e, _ in missed] + [e for (_, e), _ in taken]))
        return later(cache, layer, missed, taken)

    monkeypatch.setattr(Lossy, "step", recording_step)
    monkeypatch.setattr(ExpertCache, "read_demand", recording_read)
    monkeypatch.setattr(cache_module, "read_later", recording_later)
    return steps, reads


def run(path, **kw):
    model, tokenizer = mlxmoe.load(str(path), prefetch=0, **kw)
    tokens = [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]
    stats = model.expert_cache.stats()
    runtime = model.expert_runtime
    model.expert_runtime.close()
    return tokens, stats, runtime


@pytest.mark.parametrize("arch,kw", [("mixtral", {"trim": 0.4}), ("qwen2_moe", {"trim": 0.4}), ("olmoe", {"trim": 0.4}),
                                     ("gpt_oss", {"trim": 0.4}), ("mixtral", {"trim_mass": 0.6}),
                                     ("qwen2_moe", {"trim_mass": 0.6})])
def test_trimming_skips_exactly_the_non_resident_below_the_threshold_and_never_reads_them(checkpoint, monkeypatch,
                                                                                          arch, kw):
    path = checkpoint(arch)
    steps, reads = spy(monkeypatch)
    _, stats, runtime = run(path, cache_experts=6, **kw)
    rule = runtime.lossy.rule
    assert rule == ("topk" if arch in ("mixtral", "gpt_oss") else "softmax")  # (the tiny olmoe: no norm_topk_prob)
    skipped = 0
    for i, (logits, row, resident, _, (keep, _, _)) in enumerate(steps):
        w = weights(rule, logits, row)
        assert keep == want_keep(w / w.sum(), resident, **kw)
        gone = {e for e, k in zip(row, keep) if not k}
        skipped += len(gone)
        at = reads.index(("step", i))  # this layer call's reads come next, before the next step
        following = next((j for j in range(at + 1, len(reads)) if reads[j][0] == "step"), len(reads))
        for _, experts in reads[at + 1:following]:
            assert not gone & set(experts), "a skipped expert was read"
    assert skipped > 0 and stats["skipped"] == skipped and stats["biased"] == 0
    # every byte read is a demand load of an expert that was not skipped (prefetch off)
    assert stats["bytes_read"] == stats["loads_demand"] * runtime.cache.store.expert_file_bytes()
    _, exact, _ = run(path, cache_experts=6)
    assert stats["bytes_read"] < exact["bytes_read"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_cache_bias_moves_choices_only_toward_resident_experts(checkpoint, monkeypatch, arch):
    path = checkpoint(arch)
    steps, _ = spy(monkeypatch)
    _, stats, runtime = run(path, cache_experts=6, cache_bias=2.0)
    rule = runtime.lossy.rule
    biased = 0
    for logits, row, resident, mask, (keep, scales, n) in steps:
        assert all(keep)  # no trimming
        if mask is None:
            assert n == 0
            continue
        assert [bool(mask[e]) for e in row] == resident
        top = set(np.argsort(-logits)[:len(row)].tolist())
        assert all(mask[e] == 1 for e in set(row) - top), "a non-resident expert was biased in"
        assert all(mask[e] == 0 for e in top - set(row)), "a resident expert was biased out"
        assert n == len(set(row) - top)
        biased += n
        # the block applies the biased logits' weights; the scales give the router's own over the chosen
        applied = weights(rule, logits + 2.0 * mask, row)
        np.testing.assert_allclose(applied * np.array(scales), weights(rule, logits, row), rtol=1e-9)
    assert biased > 0 and stats["biased"] == biased and stats["skipped"] == 0
    _, exact, _ = run(path, cache_experts=6)
    assert stats["loads_demand"] < exact["loads_demand"]


def test_modes_off_add_nothing(checkpoint):
    path = checkpoint("qwen3_moe")
    tokens, stats, runtime = run(path, cache_experts=6)
    assert runtime.lossy is None and stats["skipped"] == 0 and stats["biased"] == 0
    assert all(e._lossy is None for e in runtime.checkpoint.experts)
    assert not any(type(e._router.gate).__name__.startswith("Biased") for e in runtime.checkpoint.experts)


def test_unsupported_model_type_is_refused_by_name(checkpoint):
    path = checkpoint("deepseek_v3")
    with pytest.raises(MlxmoeError, match="deepseek_v3"):
        mlxmoe.load(str(path), cache_experts=6, trim=0.2)
    with pytest.raises(MlxmoeError, match="deepseek_v3"):
        mlxmoe.load(str(path), cache_experts=6, cache_bias=1.0)


@pytest.mark.parametrize("kw", [{"trim": 1.5}, {"trim": -0.1}, {"cache_bias": -1.0}, {"cache_bias": float("inf")},
                                {"trim": True}, {"trim_mass": 1.01}, {"trim_mass": -0.5}, {"trim_mass": "0.85"},
                                {"trim_mass": float("nan")}])
def test_bad_values_are_refused(checkpoint, kw):
    with pytest.raises(MlxmoeError, match=next(iter(kw))):
        mlxmoe.load(str(checkpoint("qwen3_moe")), **kw)


def test_cli_flags(cli, checkpoint, tmp_path):
    import json

    stats = tmp_path / "stats.json"
    code, err = cli("generate", "-m", str(checkpoint("mixtral")), "--cache-experts", "6", "--trim", "0.4",
                         "--cache-bias", "1", "--prompt", PROMPT, "--max-tokens", "8", "--stats-json", str(stats))
    assert code == 0, err
    s = json.loads(stats.read_text())
    assert s["skipped"] + s["biased"] > 0
    assert "skipped" in err and "biased in" in err
    code, err = cli("generate", "--trim", "2", "--prompt", "x")
    assert code != 0 and "--trim" in err
    code, err = cli("generate", "--trim-mass", "1.5", "--prompt", "x")
    assert code != 0 and "--trim-mass" in err
    code, err = cli("generate", "-m", str(checkpoint("mixtral")), "--cache-experts", "6", "--trim-mass", "0.55",
                    "--prompt", PROMPT, "--max-tokens", "8", "--stats-json", str(stats))
    assert code == 0, err
    assert json.loads(stats.read_text())["skipped"] > 0


def test_server_usage_counts_them():
    pytest.importorskip("openai")
    from test_server import PROMPTS, Server

    server = Server("--cache-experts", "32", "--trim", "0.5", "--cache-bias", "1")
    try:
        status, _, body = server.json("POST", "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 16})
        assert status == 200
        usage = body["usage"]["mlxmoe"]
        assert usage["experts_skipped"] + usage["experts_biased"] > 0
        status, _, stats = server.json("GET", "/v1/mlxmoe/stats")
        assert stats["skipped"] >= usage["experts_skipped"] and stats["biased"] >= usage["experts_biased"]
    finally:
        server.stop()


def test_tensor_split_is_refused():
    from types import SimpleNamespace

    from mlxmoe.caching.lossy import refuse_tensor_split

    refuse_tensor_split(SimpleNamespace(group=object(), split="pipeline", path="m"), "x")  # a stage's own layers
    with pytest.raises(MlxmoeError, match="tensor split"):
        refuse_tensor_split(SimpleNamespace(group=object(), split="tensor", path="m"), "top-k trimming")
