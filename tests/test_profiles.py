"""Profiles: round trip, decay, merge, refusal of bad ones, recording (Ctrl-C included),
pre-warm, and greedy output unchanged by the policy or the profile."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx_lm
import numpy as np
import pytest
from click.testing import CliRunner

import mlxmoe
from mlxmoe.backend import detect
from mlxmoe.cli import main
from mlxmoe.errors import MlxmoeError
from mlxmoe.caching.policies import ONLINE
from mlxmoe.workload.profile import ActivationProfile

PROMPT = "The quick brown fox jumps over the lazy dog. Il gatto"
ROOT = Path(__file__).resolve().parent.parent


def make_profile(L=3, E=8, seed=0, **kw):
    p = ActivationProfile(L, E, 2, model="m", model_fingerprint="fp", workload="w", **kw)
    rng = np.random.default_rng(seed)
    for _ in range(40):
        p.tick(1)
        for l in range(L):
            e = rng.choice(E, 2, replace=False).tolist()
            p.observe(l, e, scores=[0.6, 0.3])
    return p


@pytest.mark.parametrize("half_life,tapped", [(0, False), (8, False), (8, True)])
def test_mass_summed_on_the_device_equals_the_host_s(half_life, tapped):
    """The resident path's router mass summed on the device (experts.DeviceMass: each step's
    routers queued with a later token's graph, a tapped router's logits softmaxed there) and
    read at the profile's reads and every FLUSH_TOKENS tokens gives the mass the host adds
    step by step, decay included, steps not queued yet too; a mass set anew drops what was
    unread."""
    import mlx.core as mx

    from mlxmoe.caching.experts import FLUSH_TOKENS, DeviceMass

    host, device = (make_profile(half_life=half_life) for _ in range(2))
    summed = DeviceMass.of(device)
    assert DeviceMass.of(device) is summed
    rng = np.random.default_rng(1)
    for step in range(2 * FLUSH_TOKENS + 10):
        dists = rng.dirichlet(np.ones(8), size=3).astype(np.float32)
        experts = rng.choice(8, (3, 2)).tolist()
        for p in (host, device):
            p.observe_step([0, 1, 2], [[0], [1], [2]], experts, dists if p is host else None, ticked=1)
        summed.add(mx.array(np.log(dists) + 3.0 if tapped else dists), tapped)
        if step % 3 == 1:  # (the last step's not queued)
            mx.eval(summed.queue())
        if step == FLUSH_TOKENS // 2:
            np.testing.assert_allclose(device.mass, host.mass, rtol=1e-5)  # a read between flushes
        if step == FLUSH_TOKENS + 3:  # (flushed at FLUSH_TOKENS tokens: a fresh sum since)
            assert summed.start is not None and device.tokens_total - summed.start < FLUSH_TOKENS
    assert summed.waiting and not np.array_equal(device._mass, host.mass)  # the last steps still unread
    np.testing.assert_allclose(device.mass, host.mass, rtol=1e-5)
    np.testing.assert_array_equal(device.counts, host.counts)
    summed.add(mx.array(np.ones((3, 8), np.float32)), False)
    device.mass = np.zeros((3, 8))
    assert not device.mass.any() and summed.take() is None


def test_round_trip(tmp_path):
    p = make_profile()
    p.curve = {"lru": [[2, 0.1], [4, 0.5]]}
    p.save(tmp_path / "p.json")
    q = ActivationProfile.load(tmp_path / "p.json", fingerprint="fp")
    np.testing.assert_allclose(q.counts, p.counts, atol=1e-4)
    np.testing.assert_allclose(q.mass, p.mass, atol=1e-4)
    assert (q.tokens, q.tokens_total, q.workload, q.half_life, q.curve) == \
           (pytest.approx(p.tokens), 40, "w", p.half_life, p.curve)
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["format"] == "mlxmoe.profile/1"
    assert {"model", "fingerprint", "num_layers", "num_experts", "top_k", "workload", "tokens", "decay", "counts",
            "created"} <= set(data)
    assert os.listdir(tmp_path) == ["p.json"]  # the temp file was renamed, nothing left behind


def test_decay_halves_counts_per_half_life():
    p = ActivationProfile(1, 4, 1, half_life=10)
    p.tick(1)
    p.observe(0, [2])
    before = p.counts[0, 2]
    p.tick(10)
    assert p.counts[0, 2] == pytest.approx(before / 2)
    # rates follow the recent workload: after a long run on expert 1, expert 1 dominates
    for _ in range(60):
        p.tick(1)
        p.observe(0, [1])
    assert p.rates()[0, 1] > 0.9 and p.rates()[0, 2] < 0.02


def test_learning_a_steps_calls_at_once_equals_one_by_one():
    """learn_calls (a decode step's deferred calls, Residency catch_up) leaves the profile
    exactly as learn() of each in turn: a first call that ticks, float32 and float64
    distributions; a layer twice or a distribution unknown goes one by one."""
    from mlxmoe.caching.experts import LayerCall

    rng = np.random.default_rng(3)
    L, E = 4, 8

    def call(layer, ticked=0, dtype=np.float64, known=True):
        experts = sorted(rng.choice(E, 2, replace=False).tolist())
        mean = rng.dirichlet(np.ones(E)).astype(dtype)
        return LayerCall(layer, 0, np.array([experts]), None, 1, experts, mean[experts].tolist(),
                         mean if known else None, ticked)

    steps = [[call(0, 1), call(1, 0, np.float32), call(2), call(3)],
             [call(2), call(3, 0, np.float32)],
             [call(0, 1), call(1), call(1)],  # a layer twice
             [call(0, 1), call(1, known=False), call(2)]]
    one, together = make_profile(L, E, half_life=5), make_profile(L, E, half_life=5)
    for calls in steps:
        for c in calls:
            one.learn(c)
        together.learn_calls(calls)
        assert one.tokens == together.tokens
        assert np.array_equal(one.counts, together.counts) and np.array_equal(one.mass, together.mass)


def test_merge_is_weighted():
    a = ActivationProfile(1, 4, 1, model_fingerprint="fp", workload="a")
    b = ActivationProfile(1, 4, 1, model_fingerprint="fp", workload="b")
    for _ in range(10):
        a.tick(1), a.observe(0, [0]), b.tick(1), b.observe(0, [3])
    m = ActivationProfile.merge([a, b], [3, 1])
    assert m.rates()[0, 0] == pytest.approx(0.75, abs=1e-3) and m.rates()[0, 3] == pytest.approx(0.25, abs=1e-3)
    assert m.workload == "a + b"
    other = ActivationProfile(1, 4, 1, model_fingerprint="other")
    with pytest.raises(MlxmoeError, match="different models"):
        ActivationProfile.merge([a, other])
    with pytest.raises(MlxmoeError, match="weights"):
        ActivationProfile.merge([a, b], [1])


@pytest.mark.parametrize("content,message", [
    ("{not json", "not JSON"),
    ('{"format": "something/1"}', "not a mlxmoe.profile/1"),
    ('{"format": "mlxmoe.profile/1", "num_layers": 2, "num_experts": 3, "counts": [[1, 2]], "tokens": 1}',
     r"malformed profile \(counts is \[1, 2\], the header says 2 x 3\)"),
    ('{"format": "mlxmoe.profile/1", "num_layers": 1, "num_experts": 2, "counts": [[1, 2]], "tokens": 1, '
     '"router_mass": [[1, 2, 3]]}', r"router_mass is \[1, 3\], the header says 1 x 2"),
    ('{"format": "mlxmoe.profile/1", "num_layers": 1, "num_experts": 2, "counts": [[1, -2]], "tokens": 1}',
     "non-negative"),
    ('{"format": "mlxmoe.profile/1", "num_layers": 1, "num_experts": 2, "counts": [[1, 2]]}', "malformed"),
    ('{"format": "mlxmoe.profile/1", "num_layers": 1, "num_experts": 2, "counts": [[1, 2]], "tokens": 1, '
     '"decay": 5}', "decay must be an object"),
    ('{"format": "mlxmoe.profile/1", "num_layers": 1, "num_experts": 2, "counts": [[1, 2]], "tokens": 1, '
     '"decay": {"half_life_tokens": -5}}', "half-life -5"),
    ('{"format": "mlxmoe.profile/1", "num_layers": 1, "num_experts": 2, "counts": [[1, 2]], "tokens": 1, '
     '"curve": {"lru": 5}}', "curve of 'lru'"),
    ('{"format": "mlxmoe.profile/1", "num_layers": 1, "num_experts": 2, "counts": [[1, 2]], "tokens": 1, '
     '"router_mass": [[NaN, 1]]}', "router_mass must be finite"),
])
def test_malformed_profiles_are_refused(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(MlxmoeError, match=message) as e:
        ActivationProfile.load(path)
    assert str(path) in str(e.value)


def test_unreadable_profile_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(MlxmoeError, match="cannot read profile .*file/p.json"):
        ActivationProfile.load(tmp_path / "file" / "p.json")


def test_merge_edge_cases(tmp_path):
    a, b = make_profile(seed=0), make_profile(seed=1)
    for w in ("nan", "inf"):
        with pytest.raises(MlxmoeError, match="finite"):
            ActivationProfile.merge([a, b], [float(w), 1.0])
    assert ActivationProfile.merge([a, b], [1.0, 0.0]).tokens_total == a.tokens_total  # b weighs nothing
    empty = ActivationProfile(3, 8, 2, model="m", model_fingerprint="fp", workload="empty")  # 0 tokens
    merged = ActivationProfile.merge([empty, empty])
    assert merged.tokens == 0 and not merged.mass.any()
    assert ActivationProfile.merge([a, empty]).rates() == pytest.approx(a.rates() / 2)
    assert all(row["js_divergence"] is None for row in a.diff(empty))  # undefined, not "the same"
    a.save(tmp_path / "a.json"), ActivationProfile(2, 8, 2, model_fingerprint="fp").save(tmp_path / "c.json")
    with pytest.raises(MlxmoeError, match="c.json has 2 layers .*a.json 3"):
        ActivationProfile.merge([ActivationProfile.load(tmp_path / f) for f in ("a.json", "c.json")])


def test_lru_curve_matches_replay_below_a_prefill(tmp_path):
    """A cache smaller than a prefill's experts splits the call as the runtime does; the
    curve's LRU points are then replays, equal to `trace replay` at every size."""
    from mlxmoe.workload.curves import predicted_curve
    from mlxmoe.workload.trace import replay

    rng = np.random.default_rng(0)
    header = {"num_layers": 2, "num_experts": 16, "top_k": 2}
    records = [(0, t, l, rng.choice(16, 2, replace=False).tolist(), None, None) for t in range(12) for l in (0, 1)]
    records.sort(key=lambda r: (r[2] if r[1] < 8 else 2, r[1]))  # tokens 0-7: one prefill call per layer
    curve = predicted_curve(header, records, ["lru"], shares=(0.1, 0.25, 0.5, 1.0))["lru"]
    assert [c for c, _ in curve] == [3, 8, 16, 32]
    for c, rate in curve:
        assert rate == pytest.approx(replay(header, records, "lru", c)["hit_rate"], abs=1e-4)


def test_profile_of_another_model_is_refused(checkpoint, tmp_path):
    a = checkpoint("qwen3_moe", quant="4bit")
    b = checkpoint("qwen3_moe")  # same shapes, float32: another fingerprint
    model, tokenizer = mlxmoe.load(str(a))
    mlxmoe.generate(model, tokenizer, PROMPT, max_tokens=5)
    model.expert_cache.profile.save(tmp_path / "a.json")
    with pytest.raises(MlxmoeError, match="another model"):
        mlxmoe.load(str(b), profile=str(tmp_path / "a.json"))
    mlxmoe.load(str(b), profile=str(tmp_path / "a.json"), force_profile=True)  # shapes agree
    c = checkpoint("deepseek_v3", quant="4bit")  # 2 MoE layers x 16 experts: --force cannot help
    with pytest.raises(MlxmoeError, match="layers"):
        mlxmoe.load(str(c), profile=str(tmp_path / "a.json"), force_profile=True)
    r = CliRunner().invoke(main, ["generate", "--model", str(b), "--prompt", "hi", "--profile",
                                  str(tmp_path / "a.json")])
    assert r.exit_code != 0 and "another model" in str(r.exception)


def reference(path, tokens=24):
    model, tokenizer = mlx_lm.load(str(path))
    detect().apply_dtype_policy(model)
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=tokens)]


@pytest.mark.parametrize("policy", ONLINE)
def test_greedy_output_unchanged_by_policy_and_profile(checkpoint, tmp_path, policy):
    path = checkpoint("deepseek_v3", quant="4bit")
    want = reference(path)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=6, policy=policy)
    assert [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=24)] == want
    model.expert_cache.profile.save(tmp_path / "p.json")
    model, tokenizer = mlxmoe.load(str(path), cache_experts=6, policy=policy, profile=str(tmp_path / "p.json"))
    assert [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=24)] == want


def test_prewarm_loads_hottest_without_double_reads(checkpoint, tmp_path):
    path = checkpoint("qwen3_moe", quant="4bit")
    model, tokenizer = mlxmoe.load(str(path), cache_experts=12)
    mlxmoe.generate(model, tokenizer, PROMPT, max_tokens=20)
    live = model.expert_cache.profile
    live.save(tmp_path / "p.json")
    hottest = live.priority()[:12]
    model, tokenizer = mlxmoe.load(str(path), cache_experts=12, profile=str(tmp_path / "p.json"), prefetch=0)
    cache = model.expert_cache
    assert cache.prewarm_done(timeout=30)  # (the decode thread may take free slots first otherwise)
    mlxmoe.generate(model, tokenizer, PROMPT, max_tokens=20)
    s = cache.stats()
    assert s["loads_prefetched"] == len(hottest)
    assert 0 < s["prefetch_useful"] <= s["loads_prefetched"]
    assert s["bytes_read"] == (s["loads_demand"] + s["loads_prefetched"]) * cache.store.expert_file_bytes()
    cold, tok2 = mlxmoe.load(str(path), cache_experts=12, prefetch=0)
    mlxmoe.generate(cold, tok2, PROMPT, max_tokens=20)
    assert s["loads_demand"] < cold.expert_cache.stats()["loads_demand"]  # the profile saved reads


def test_record_show_diff_merge_cli(checkpoint, tmp_path):
    path = checkpoint("olmoe", quant="4bit")
    it, en = tmp_path / "it.txt", tmp_path / "en.txt"
    it.write_text("Il gatto dorme sul divano\nLa casa è grande e bella\n")
    en.write_text("The cat sleeps on the sofa\nThe house is big and nice\n")
    runner = CliRunner()
    for name, prompts in (("it", it), ("en", en)):
        r = runner.invoke(main, ["profile", "record", "--model", str(path), "--prompts", str(prompts), "--workload",
                                 f"{name} text", "-o", str(tmp_path / f"{name}.json"), "--max-tokens", "12"])
        assert r.exit_code == 0, r.output
        assert "recording 2 prompts" in r.stderr
        assert "predicting the hit rate at each cache size, policy by policy" in r.stderr
    p = ActivationProfile.load(tmp_path / "it.json")
    assert p.workload == "it text" and p.tokens_total > 20 and set(p.curve) == set(ONLINE)
    r = runner.invoke(main, ["profile", "show", str(tmp_path / "it.json"), "--png", str(tmp_path / "h.png")])
    assert r.exit_code == 0 and "predicted hit rate" in r.stdout and "layer   0" in r.stdout
    lines = r.stdout.splitlines()
    header = lines[lines.index("predicted hit rate by cache size:") + 1].split()
    assert header == ["experts", "memory", *ONLINE]  # every policy's name apart, activation-floor too
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = runner.invoke(main, ["profile", "diff", str(tmp_path / "it.json"), str(tmp_path / "en.json"), "--json"])
    layers = json.loads(r.stdout)["layers"]
    assert len(layers) == p.num_layers and all(0 <= row["js_divergence"] <= 1 for row in layers)
    r = runner.invoke(main, ["profile", "merge", str(tmp_path / "it.json"), str(tmp_path / "en.json"), "-o",
                             str(tmp_path / "both.json"), "--weights", "1,1"])
    assert r.exit_code == 0
    assert ActivationProfile.load(tmp_path / "both.json").workload == "it text + en text"


def test_trace_record_says_one_prompt(checkpoint, tmp_path):
    path = checkpoint("qwen3_moe", quant="4bit")
    (tmp_path / "p.txt").write_text("The cat sleeps on the sofa\n")
    r = CliRunner().invoke(main, ["trace", "record", "--model", str(path), "--prompts", str(tmp_path / "p.txt"),
                                  "-o", str(tmp_path / "t.jsonl"), "--max-tokens", "4"])
    assert r.exit_code == 0, r.output
    assert "tracing 1 prompt" in r.stderr and "1 prompts" not in r.stderr


def test_record_half_life_fresh_counts_and_bad_paths(checkpoint, tmp_path, monkeypatch):
    path = checkpoint("qwen3_moe", quant="4bit")
    prompts = tmp_path / "p.txt"
    prompts.write_text("The cat sleeps on the sofa\nThe house is big and nice\n")
    runner = CliRunner()
    args = ["profile", "record", "--model", str(path), "--prompts", str(prompts), "-w", "w", "--max-tokens", "8"]
    assert runner.invoke(main, args + ["-o", str(tmp_path / "a.json")]).exit_code == 0
    a = ActivationProfile.load(tmp_path / "a.json")
    # --half-life decays what is recorded; --profile is a prior, its counts are not recorded again
    r = runner.invoke(main, args + ["-o", str(tmp_path / "b.json"), "--half-life", "2", "--profile",
                                    str(tmp_path / "a.json")])
    assert r.exit_code == 0, r.output
    b = ActivationProfile.load(tmp_path / "b.json")
    assert b.half_life == 2 and b.tokens_total == a.tokens_total and b.tokens < 10 < 40 < a.tokens
    # Ctrl-C while the curve is computed: the profile is saved without it
    import mlxmoe.api

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(mlxmoe.api, "predicted_curve", interrupted)
    r = runner.invoke(main, args + ["-o", str(tmp_path / "c.json")])
    assert r.exit_code == 130 and "without the hit-rate curve" in r.output
    c = ActivationProfile.load(tmp_path / "c.json")
    assert c.tokens_total == a.tokens_total and c.curve == {}
    # bad input fails before any work and leaves nothing behind
    before = set(tmp_path.iterdir())
    for bad in (["-o", str(tmp_path / "nodir" / "p.json")], ["-o", str(tmp_path / "d.json"), "--half-life", "-1"],
                ["-o", str(tmp_path / "d.json"), "--max-tokens", "0"]):
        r = runner.invoke(main, args + bad)
        assert r.exit_code != 0 and "Traceback" not in r.output
    assert "folder" in str(runner.invoke(main, args + ["-o", str(tmp_path / "nodir" / "p.json")]).exception)
    (tmp_path / "empty.txt").write_text("\n")
    r = runner.invoke(main, ["trace", "record", "--model", str(path), "--prompts", str(tmp_path / "empty.txt"),
                             "-o", str(tmp_path / "t.jsonl")])
    assert "no prompts" in str(r.exception)
    assert set(tmp_path.iterdir()) == before | {tmp_path / "empty.txt"}  # no trace, no temp file
    r = runner.invoke(main, ["generate", "--model", str(path), "-p", "hi", "--stats-json",
                             str(tmp_path / "nodir" / "s.json")])
    assert "folder" in str(r.exception)
    r = runner.invoke(main, ["profile", "show", str(tmp_path / "a.json"), "--budget", "100TB", "--json"])
    assert json.loads(r.stdout)["budget"]["cache_experts"] == a.num_layers * a.num_experts


def test_show_reads_the_hit_rate_a_budget_buys_off_the_curve(tmp_path):
    from mlxmoe.workload.curves import curve_at

    points = [[2, 0.1], [6, 0.5], [12, 0.9]]
    assert curve_at(points, 4) == pytest.approx(0.3) and curve_at(points, 12) == 0.9 and curve_at(points, 2) == 0.1
    assert curve_at(points, 1) is None and curve_at(points, 13) is None
    p = ActivationProfile(2, 8, 2, expert_bytes=1000, resident_bytes=10_000)
    p.curve = {"lru": points, "activation": [[2, 0.2], [6, 0.6], [12, 0.95]]}
    p.save(tmp_path / "p.json")
    show = lambda budget, *more: CliRunner().invoke(main, ["profile", "show", str(tmp_path / "p.json"),
                                                           "--budget", budget, *more])
    out = json.loads(show("14000B", "--json").stdout)["budget"]  # 4 experts beside 10,000 bytes
    assert out["cache_experts"] == 4
    assert out["predicted_hit_rate"] == {"lru": pytest.approx(0.3), "activation": pytest.approx(0.4)}
    assert "predicted hit rate there: lru 30.0%, activation 40.0%" in show("14000B").output
    assert "too small: a layer needs 2 experts at once" in show("11000B").output


def test_chat_saves_profile_and_trace(checkpoint, tmp_path):
    path = checkpoint("qwen3_moe", quant="4bit")
    r = CliRunner().invoke(main, ["chat", "--model", str(path), "--max-tokens", "8", "--save-profile",
                                  str(tmp_path / "live.json"), "--trace-out", str(tmp_path / "t.jsonl")],
                           input="ciao\n/quit\n")
    assert r.exit_code == 0, r.output
    live = ActivationProfile.load(tmp_path / "live.json")
    assert live.tokens_total > 8 and live.workload == "live"  # unnamed: after its file
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["format"] == "mlxmoe.trace/1" and len(lines) > 10
    # a profile loaded and saved back keeps its predicted hit-rate curve; blank lines are not sent
    p = make_profile()
    p.curve = {"lru": [[4, 0.5]]}
    p.model, p.fingerprint = live.model, live.fingerprint
    p.num_layers, p.num_experts = live.num_layers, live.num_experts
    p.counts, p.mass = live.counts, live.mass
    p.save(tmp_path / "named.json")
    r = CliRunner().invoke(main, ["chat", "--model", str(path), "--max-tokens", "4", "--profile",
                                  str(tmp_path / "named.json"), "--save-profile", str(tmp_path / "named.json")],
                           input="\n\nciao\nq\n/quit\n")
    assert r.exit_code == 0, r.output
    saved = ActivationProfile.load(tmp_path / "named.json")
    assert saved.curve == {"lru": [[4, 0.5]]} and saved.workload == "w"
    assert r.stderr.count(", expert hit rate") == 2  # "ciao" and "q" got replies; the blank lines did not


def test_ctrl_c_during_record_leaves_a_valid_profile(checkpoint, tmp_path):
    path = checkpoint("qwen3_moe", config_overrides={"hidden_size": 256, "moe_intermediate_size": 256,
                                                     "num_hidden_layers": 6, "num_experts": 32})
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"prompt number {i} about cats and dogs" for i in range(200)))
    out = tmp_path / "out.json"
    proc = subprocess.Popen([sys.executable, "-m", "mlxmoe", "profile", "record", "--model", str(path), "--prompts",
                             str(prompts), "-w", "cut short", "-o", str(out), "--max-tokens", "64"],
                            stderr=subprocess.PIPE, text=True)
    lines = [proc.stderr.readline()]  # the progress bar's label: recording has started,
    while "recording" not in lines[-1] and lines[-1] and len(lines) < 5:  # after notes of slow start-up steps
        lines.append(proc.stderr.readline())
    assert "recording" in lines[-1], lines
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, err
    assert "interrupted" in err
    p = ActivationProfile.load(out)
    assert p.workload == "cut short" and 0 < p.tokens_total < 200 * 64
    assert [f.name for f in tmp_path.iterdir() if f.name.endswith(".tmp")] == []


def test_first_token_does_not_wait_for_the_prewarm(monkeypatch):
    """The demo model at 50 % cache with the Italian profile, pre-warm reads slowed to
    0.1 s each (64 of them): the first token comes while the pre-warm is still reading,
    with few of its reads done, and greedy output is what it is without a profile."""
    import threading
    from pathlib import Path

    from mlxmoe.storage.store import ExpertStore

    italian = Path(__file__).resolve().parents[1] / "profiles" / "italian.json"
    prompt = "Il gatto dorme"
    model, tokenizer = mlxmoe.load(None, cache_experts=64, prefetch=0)
    want = [r.token for r in mlxmoe.stream_generate(model, tokenizer, prompt, max_tokens=8)]
    model.expert_cache.close()
    read = ExpertStore.read_expert

    def slow_prewarm(self, layer, expert, outs, **kw):
        if threading.current_thread().name == "mlxmoe-prewarm":
            time.sleep(0.1)
        return read(self, layer, expert, outs, **kw)

    monkeypatch.setattr(ExpertStore, "read_expert", slow_prewarm)
    model, tokenizer = mlxmoe.load(None, cache_experts=64, profile=str(italian), prefetch=0)
    cache = model.expert_cache
    got, at_first = [], None
    for r in mlxmoe.stream_generate(model, tokenizer, prompt, max_tokens=8):
        if not got:
            at_first = (cache.prewarm_done(0), cache.counters.loads_prefetched)
        got.append(r.token)
    assert at_first[0] is False and at_first[1] < 32
    assert got == want
    assert cache.prewarm_done(timeout=30)
    cache.close()


def test_chats_file_renders_with_the_template_and_names_bad_lines(tmp_path):
    from mlx_lm.utils import load_tokenizer

    from mlxmoe.api import read_prompts
    from mlxmoe.loader import DEMO_MODEL

    tokenizer = load_tokenizer(DEMO_MODEL)
    chat = [{"role": "user", "content": "Ciao, come stai?"}]
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": chat}) + "\n\n" + json.dumps(chat) + "\n")
    want = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert read_prompts(path, tokenizer, chats=True) == [want, want]
    for bad, message in [('{"messages": []}', "non-empty list of messages"), ('{"messages": "hi"}', "non-empty list"),
                         ("not json", "not a chat"), ('[{"role": "user"}]', "a role and a content")]:
        path.write_text(json.dumps(chat) + "\n\n" + bad + "\n")  # line 3: blank lines count
        with pytest.raises(MlxmoeError, match=f"chats.jsonl:3: .*{message}"):
            read_prompts(path, tokenizer, chats=True)


def read_png(path):
    """An RGB PNG as written by mlxmoe.workload.heatmap (8-bit, filter 0 on every row) as an array."""
    import struct
    import zlib

    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        n, tag = struct.unpack(">I4s", data[pos:pos + 8])
        if tag == b"IHDR":
            size = struct.unpack(">II", data[pos + 8:pos + 16])
        elif tag == b"IDAT":
            idat += data[pos + 8:pos + 8 + n]
        pos += 12 + n
    w, h = size
    rows = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(h, w, 3)


def test_profile_pngs_have_axes_labels_and_scales(tmp_path):
    """The heatmap: cells coloured on one scale (the hottest yellow, the coldest dark), a
    colour bar beside them, labels (black text) on both axes. The curve: a line per policy
    in its colour and, with --budget, a dashed line at the cache the budget buys."""
    from mlxmoe.workload.heatmap import COLORS, VIRIDIS

    profile = ROOT / "profiles" / "italian.json"
    p = ActivationProfile.load(profile)
    r = CliRunner().invoke(main, ["profile", "show", str(profile), "--png", str(tmp_path / "h.png"), "--curve-png",
                                  str(tmp_path / "c.png"), "--budget", "46MB", "--json"])
    assert r.exit_code == 0, r.output
    c = json.loads(r.stdout)["budget"]["cache_experts"]
    img = read_png(tmp_path / "h.png")
    rgb = img.reshape(-1, 3)
    colours = {tuple(x) for x in rgb}
    assert tuple(VIRIDIS[-1].astype(np.uint8)) in colours and tuple(VIRIDIS[0].astype(np.uint8)) in colours
    black = (img == 0).all(axis=2)
    h, w = black.shape
    assert black[:, :40].sum() > 50 and black[-30:, :].sum() > 100  # layer labels, expert labels
    bar = img[:, -90:].reshape(-1, 3)  # the colour scale, right of the cells
    assert len({tuple(x) for x in bar} - {(255, 255, 255), (0, 0, 0)}) > 20
    img = read_png(tmp_path / "c.png")
    for colour in COLORS[:len(p.curve)]:
        assert (img == colour).all(axis=2).sum() > 100, colour
    left, pw = 48, img.shape[1] - 48 - 16
    x = int(round(left + c / (p.num_layers * p.num_experts) * pw))
    column = (img[:, x - 1:x + 2] == 0).all(axis=2).any(axis=1)
    assert 100 < column.sum() < img.shape[0] * 0.8  # dashed: on and off down the plot
    # a profile built from routing alone: no budget to show, and said so
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"format": "mlxmoe.trace/1", "num_layers": 2, "num_experts": 4, "top_k": 1, "model": ""}\n'
                     + "".join(f'{{"s": 0, "t": {t}, "l": {l}, "e": [{(t + l) % 4}]}}\n' for t in range(8)
                               for l in range(2)))
    r = CliRunner().invoke(main, ["profile", "from-trace", str(trace), "-o", str(tmp_path / "w.json")])
    assert r.exit_code == 0 and "a model known by its shape only" in r.stderr, r.output
    r = CliRunner().invoke(main, ["profile", "show", str(tmp_path / "w.json"), "--budget", "1GB"])
    assert r.exit_code == 0 and "does not hold the model's expert size" in r.stderr, r.output
    r = CliRunner().invoke(main, ["profile", "from-trace", str(trace), "--no-curve", "-o", str(tmp_path / "n.json")])
    r = CliRunner().invoke(main, ["profile", "show", str(tmp_path / "n.json"), "--curve-png", str(tmp_path / "x.png")])
    assert r.exit_code != 0 and "no predicted hit-rate curve" in str(r.exception)
