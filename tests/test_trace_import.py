"""`trace import`: each format converted from a small hand-made file, read back as the
runtime's trace reader sees it, malformed input named by file and line, and an imported
trace replayed through the cache policies."""

import base64
import json

import numpy as np
import pytest
from click.testing import CliRunner

from mlxmoe.cli import main
from mlxmoe.errors import MlxmoeError
from mlxmoe.workload.profile import ActivationProfile
from mlxmoe.workload.trace import PREFILL_STEP, import_trace, layer_calls, read_trace, replay


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lines_of(records):
    """(s, t, l, experts, probs, tokens of the call or None, phase) of each record."""
    return [(s, t, l, e, p, n, ph) for s, t, l, e, p, _, n, ph in records]


def test_specmoe_round_trip_orders_tokens_and_keeps_problems(tmp_path):
    rows = []  # the source lists one layer's tokens after another, as speculative-moe does
    for pid in (0, 1):
        for layer in range(2):
            for t in range(3):
                rows.append({"dataset": "gsm8k", "problem_id": pid, "layer": layer, "experts": [t, 7 - layer - pid],
                             "gating_probs": [0.75, 0.25], "token_idx": t})
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    summary, warnings = import_trace("specmoe", src, tmp_path / "t.jsonl")
    assert warnings == [] and summary["sequences"] == 2 and summary["tokens"] == 6
    header, records = read_trace(tmp_path / "t.jsonl")
    assert (header["num_layers"], header["num_experts"], header["top_k"]) == (32, 8, 2)
    assert header["sequences"] == ["gsm8k/0", "gsm8k/1"]
    expected = [(s, t, l, [t, 7 - l - s], [0.75, 0.25], None, None) for s in (0, 1) for t in range(3) for l in (0, 1)]
    assert lines_of(records) == expected
    # --only keeps the chosen problems, renumbered from 0
    import_trace("specmoe", src, tmp_path / "one.jsonl", only=["1"])
    header, records = read_trace(tmp_path / "one.jsonl")
    assert header["sequences"] == ["gsm8k/1"] and {r[0] for r in records} == {0}
    assert [r[3] for r in records[:2]] == [[0, 6], [0, 5]]
    with pytest.raises(MlxmoeError, match="no sequence 5"):
        import_trace("specmoe", src, tmp_path / "none.jsonl", only=["5"])


def test_malformed_line_is_named_and_nothing_is_written(tmp_path):
    good = {"dataset": "d", "problem_id": 0, "layer": 0, "experts": [1, 2], "gating_probs": [0.5, 0.5], "token_idx": 0}
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps(good) + "\n" + json.dumps(good | {"token_idx": 1}) + "\n{not json\n")
    out = tmp_path / "t.jsonl"
    with pytest.raises(MlxmoeError, match=r"r\.jsonl:3: not JSON"):
        import_trace("specmoe", src, out)
    src.write_text(json.dumps(good) + "\n\n" + json.dumps(good | {"experts": [1, 9]}) + "\n")
    with pytest.raises(MlxmoeError, match=r"r\.jsonl:3: layer 0 or experts \[1, 9\] out of range for 32 layers x 8"):
        import_trace("specmoe", src, out)
    src.write_text(json.dumps(good | {"gating_probs": [1.0]}) + "\n")
    with pytest.raises(MlxmoeError, match=r"r\.jsonl:1: 1 weights for 2 experts"):
        import_trace("specmoe", src, out)
    assert list(tmp_path.iterdir()) == [src]  # no trace, no temp file
    # the command prints one line naming the file and line, and exits 2
    src.write_text(json.dumps(good) + "\n" + json.dumps({"problem_id": 0, "layer": "x"}) + "\n")
    r = CliRunner().invoke(main, ["trace", "import", "specmoe", str(src), "-o", str(out)], standalone_mode=False)
    assert isinstance(r.exception, MlxmoeError) and f"{src}:2:" in str(r.exception)
    assert not out.exists()


def bigmoeonedge_csv(path, rows, preamble="# route_trace v1\n# model=/x/Tiny-MoE-Q4.gguf arch=t n_layer=2 "
                     "n_expert=6 n_expert_used=2\n# layer=0 expert_bytes=1 dense_bytes=1\n"):
    body = "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes\n"
    body += "".join(",".join(str(v) for v in row) + ",0,1\n" for row in rows)
    path.write_text(preamble + body)
    return path


def test_bigmoeonedge_prefill_is_one_call_per_layer_and_slots_rank_experts(tmp_path):
    rows = []
    for step in range(4):  # prompt of 3 tokens (steps 0-2), then 1 decode step
        phase = 0 if step < 3 else 1
        for layer in range(2):
            # slots listed out of order: the importer ranks by slot
            rows.append((0, phase, step, layer, 1, (step + layer + 1) % 6, 0.4))
            rows.append((0, phase, step, layer, 0, (step + layer) % 6, 0.6))
    src = bigmoeonedge_csv(tmp_path / "m.route.csv", rows)
    summary, _ = import_trace("bigmoeonedge", src, tmp_path / "t.jsonl")
    assert (summary["tokens"], summary["prefill_tokens"]) == (4, 3)
    header, records = read_trace(tmp_path / "t.jsonl")
    assert (header["num_layers"], header["num_experts"], header["top_k"], header["model"]) == (2, 6, 2, "Tiny-MoE-Q4")
    e = lambda t, l: [(t + l) % 6, (t + l + 1) % 6]
    assert lines_of(records) == [
        # all prompt tokens but the last: one call per layer, as mlx-lm prefills
        (0, 0, 0, e(0, 0), [0.6, 0.4], 2, "prefill"), (0, 1, 0, e(1, 0), [0.6, 0.4], 2, "prefill"),
        (0, 0, 1, e(0, 1), [0.6, 0.4], 2, "prefill"), (0, 1, 1, e(1, 1), [0.6, 0.4], 2, "prefill"),
        # the prompt's last token alone (mlx-lm runs it with the first sampling step), then decode
        (0, 2, 0, e(2, 0), [0.6, 0.4], None, "prefill"), (0, 2, 1, e(2, 1), [0.6, 0.4], None, "prefill"),
        (0, 3, 0, e(3, 0), [0.6, 0.4], None, None), (0, 3, 1, e(3, 1), [0.6, 0.4], None, None)]
    assert [len(call) for call in layer_calls(records, 2)] == [2, 2, 1, 1, 1, 1]
    bigmoeonedge_csv(src, rows[:3] + [(0, 0, "x", 0, 0, 1, 0.5)])
    with pytest.raises(MlxmoeError, match=r"m\.route\.csv:8: malformed row"):
        import_trace("bigmoeonedge", src, tmp_path / "t.jsonl")


def test_moe_ocs_ranks_experts_by_weight(tmp_path):
    routes = [{"token_pos": t, "token_id": 5, "phase": "prefill" if t < 2 else "decode",
               "layers": {str(l): {"experts": [t + l, 9 - l], "weights": [0.3, 0.7]} for l in range(3)}}
              for t in range(4)]
    meta = {"model_id": "Tiny-256", "num_layers": 3, "num_moe_layers": 3, "num_experts": 10, "top_k": 2}
    src = tmp_path / "routing.json"
    src.write_text(json.dumps({"meta": meta, "prompt_tokens": [5, 5], "generated_tokens": [5, 5], "routes": routes}))
    summary, _ = import_trace("moe-ocs", src, tmp_path / "t.jsonl")
    assert (summary["tokens"], summary["prefill_tokens"]) == (4, 2)
    header, records = read_trace(tmp_path / "t.jsonl")
    assert (header["num_layers"], header["num_experts"], header["model"]) == (3, 10, "Tiny-256")
    # a prompt of 2: token 0 is a one-token prefill call, token 1 runs alone
    assert [(r[1], r[2], r[3], r[4], r[7]) for r in records[:3]] == [
        (0, 0, [9, 0], [0.7, 0.3], "prefill"), (0, 1, [8, 1], [0.7, 0.3], "prefill"),
        (0, 2, [7, 2], [0.7, 0.3], "prefill")]
    assert [(r[1], r[2], r[7]) for r in records[-3:]] == [(3, 0, None), (3, 1, None), (3, 2, None)]
    routes[1]["layers"]["2"] = {"experts": [1], "weights": [0.5, 0.5]}
    src.write_text(json.dumps({"meta": meta, "routes": routes}))
    with pytest.raises(MlxmoeError, match=r"routing\.json: routes\[1\]\.layers\['2'\]: 2 weights for 1 experts"):
        import_trace("moe-ocs", src, tmp_path / "t.jsonl")


def test_vllm_requests_prefill_runs_and_profiling_run_dropped(tmp_path):
    rows = []
    # a profiling run: one routing repeated for 10 tokens at every layer
    for t in range(10):
        for l in range(2):
            rows.append({"type": "route", "req_id": "dummy", "token_idx": t, "layer": l, "topk_ids": [0, 1],
                         "topk_weights": [0.5, 0.5]})
    rows.append({"type": "stats", "note": "other record types are skipped"})
    # request a: a prompt of 3 logged layer by layer (a forward pass), then 2 decode steps,
    # interleaved with request b's decode steps
    for l in range(2):
        for t in range(3):
            rows.append({"type": "route", "req_id": "a", "token_idx": t, "layer": l, "topk_ids": [t, 5 - l],
                         "topk_weights": [0.9, 0.1]})
    for t in (3, 4):
        for req in ("a", "b"):
            for l in range(2):
                rows.append({"type": "route", "req_id": req, "token_idx": t, "layer": l, "topk_ids": [t, l],
                             "topk_weights": [0.6, 0.4]})
    src = write_jsonl(tmp_path / "routes.jsonl", rows)
    summary, warnings = import_trace("vllm", src, tmp_path / "t.jsonl", num_experts=8)
    assert any("dropped the first 20 routing rows (through line 20)" in w for w in warnings)
    assert summary["sequences"] == 2 and summary["prefill_tokens"] == 3
    header, records = read_trace(tmp_path / "t.jsonl")
    assert header["sequences"] == ["a", "b"] and header["num_experts"] == 8
    assert lines_of(records) == [
        (0, 0, 0, [0, 5], [0.9, 0.1], 2, "prefill"), (0, 1, 0, [1, 5], [0.9, 0.1], 2, "prefill"),
        (0, 0, 1, [0, 4], [0.9, 0.1], 2, "prefill"), (0, 1, 1, [1, 4], [0.9, 0.1], 2, "prefill"),
        (0, 2, 0, [2, 5], [0.9, 0.1], None, "prefill"), (0, 2, 1, [2, 4], [0.9, 0.1], None, "prefill"),
        (0, 3, 0, [3, 0], [0.6, 0.4], None, None), (0, 3, 1, [3, 1], [0.6, 0.4], None, None),
        (0, 4, 0, [4, 0], [0.6, 0.4], None, None), (0, 4, 1, [4, 1], [0.6, 0.4], None, None),
        (1, 3, 0, [3, 0], [0.6, 0.4], None, None), (1, 3, 1, [3, 1], [0.6, 0.4], None, None),
        (1, 4, 0, [4, 0], [0.6, 0.4], None, None), (1, 4, 1, [4, 1], [0.6, 0.4], None, None)]
    # without --num-experts the largest id + 1 is taken, with a warning
    summary, warnings = import_trace("vllm", src, tmp_path / "t.jsonl")
    assert summary["num_experts"] == 6 and any("--num-experts" in w for w in warnings)
    # a meta line names the model; a log of one layer has no prefill runs to see: decode
    one = [{"type": "meta", "model_id": "org/Tiny", "num_experts": 7, "top_k": 2}] + [r for r in rows[21:] if r["layer"] == 0]
    summary, warnings = import_trace("vllm", write_jsonl(tmp_path / "one.jsonl", one), tmp_path / "t.jsonl")
    header, records = read_trace(tmp_path / "t.jsonl")
    assert (header["model"], header["num_experts"], summary["prefill_tokens"], warnings) == ("org/Tiny", 7, 0, [])
    assert [(r[1], r[6]) for r in records[:3]] == [(0, None), (1, None), (2, None)]
    rows[25] = {"type": "route", "req_id": "a", "token_idx": 1, "layer": 0, "topk_ids": "x"}
    write_jsonl(src, rows)
    with pytest.raises(MlxmoeError, match=r"routes\.jsonl:26: expert ids and weights must be lists"):
        import_trace("vllm", src, tmp_path / "t.jsonl")


def test_sglang_generate_and_openai_responses(tmp_path):
    rng = np.random.default_rng(0)
    L, K, prompt, completion = 3, 2, 4, 3
    ids = np.stack([np.stack([rng.choice(16, K, replace=False) for _ in range(L)]) for _ in range(prompt + completion - 1)])
    ids[:, 0] = -1  # layer 0 is dense: no routed experts
    payload = base64.b64encode(ids.astype(np.int32).tobytes()).decode()
    generate = {"text": "...", "meta_info": {"id": "r1", "prompt_tokens": prompt, "completion_tokens": completion,
                                             "routed_experts": payload}}
    openai = {"id": "c2", "choices": [{"index": 0, "text": "...", "sgl_ext": {"routed_experts": payload}}],
              "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}
    src = write_jsonl(tmp_path / "responses.jsonl", [generate, openai])
    with pytest.raises(MlxmoeError, match="--num-layers"):
        import_trace("sglang", src, tmp_path / "t.jsonl")
    with pytest.raises(MlxmoeError, match="give --top-k"):  # OpenAI responses lack the completion count here
        import_trace("sglang", src, tmp_path / "t.jsonl", num_layers=L)
    summary, warnings = import_trace("sglang", src, tmp_path / "t.jsonl", num_layers=L, top_k=K, num_experts=16)
    assert any("dropped 1 layers without routed experts" in w for w in warnings)
    assert (summary["sequences"], summary["tokens"], summary["prefill_tokens"]) == (2, 12, 8)
    header, records = read_trace(tmp_path / "t.jsonl")
    assert (header["num_layers"], header["num_experts"], header["top_k"]) == (2, 16, 2)
    assert header["sequences"] == ["r1", "c2/0"]
    for s in (0, 1):
        seq = [r for r in records if r[0] == s]
        assert sorted((r[1], r[2], r[3]) for r in seq) == [
            (t, l - 1, ids[t, l].tolist()) for t in range(prompt + completion - 1) for l in (1, 2)]
        assert [r[1] for r in seq if r[7] == "prefill"] == [0, 1, 2, 0, 1, 2, 3, 3]
    # a /generate response alone: top-k follows from its token counts
    src.write_text(json.dumps(generate))
    summary, _ = import_trace("sglang", src, tmp_path / "t.jsonl", num_layers=L, num_experts=16)
    assert summary["top_k"] == K and summary["sequences"] == 1
    generate["meta_info"]["routed_experts"] = payload[:-4] + "!!!!"
    src.write_text(json.dumps(generate))
    with pytest.raises(MlxmoeError, match=r"responses\.jsonl:1: routed_experts is not base64"):
        import_trace("sglang", src, tmp_path / "t.jsonl", num_layers=L)


def test_long_prompt_is_split_as_mlx_lm_prefills(tmp_path):
    n = PREFILL_STEP + 5  # a prompt longer than one prefill call, then one decode token
    routes = [{"token_pos": t, "phase": "prefill" if t < n else "decode",
               "layers": {"0": {"experts": [t % 4], "weights": [1.0]}}} for t in range(n + 1)]
    src = tmp_path / "r.json"
    src.write_text(json.dumps({"meta": {"num_moe_layers": 1, "num_experts": 4, "top_k": 1}, "routes": routes}))
    import_trace("moe-ocs", src, tmp_path / "t.jsonl")
    _, records = read_trace(tmp_path / "t.jsonl")
    assert [len(c) for c in layer_calls(records, 1)] == [PREFILL_STEP, 4, 1, 1]


def test_imported_trace_replays(tmp_path):
    """A replay of an imported trace counts the hits the same routing gives when written
    directly in mlxmoe's format, and the command line replays it."""
    rng = np.random.default_rng(1)
    L, E, T = 4, 8, 40
    routing = [[rng.choice(E, 2, replace=False, p=np.linspace(1, 3, E) / np.linspace(1, 3, E).sum()).tolist()
                for _ in range(L)] for _ in range(T)]
    rows = [{"dataset": "x", "problem_id": 3, "layer": l, "token_idx": t, "experts": routing[t][l],
             "gating_probs": [0.6, 0.4]} for l in range(L) for t in range(T)]
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    out = tmp_path / "imported.trace.jsonl"
    r = CliRunner().invoke(main, ["trace", "import", "specmoe", str(src), "-o", str(out), "--num-layers", "4"])
    assert r.exit_code == 0, r.output
    header, records = read_trace(out)
    direct = tmp_path / "direct.trace.jsonl"
    direct.write_text(json.dumps({"format": "mlxmoe.trace/1", "num_layers": L, "num_experts": 8, "top_k": 2}) + "\n" +
                      "".join(json.dumps({"s": 0, "t": t, "l": l, "e": routing[t][l], "p": [0.6, 0.4]}) + "\n"
                              for t in range(T) for l in range(L)))
    dh, dr = read_trace(direct)
    for policy in ("lru", "lfu", "activation", "belady"):
        got = replay(header, records, policy, 12)
        assert got["accesses"] == T * L * 2
        assert got["hits"] == replay(dh, dr, policy, 12)["hits"]
    r = CliRunner().invoke(main, ["trace", "replay", str(out), "--policy", "lru", "--cache-experts", "12", "--json"])
    assert json.loads(r.stdout)["hits"] == replay(dh, dr, "lru", 12)["hits"]


def test_profile_from_trace_counts_as_the_live_profile_learns(tmp_path):
    """Each layer call counts its distinct experts once (a prefill of 2 tokens too), the
    first layer ticks by the call's tokens; an imported trace's profile has its shape's
    fingerprint, so a real model takes it only with --force and agreeing shapes."""
    routes = [{"token_pos": t, "phase": "prefill" if t < 3 else "decode",
               "layers": {"0": {"experts": [t % 2, 2], "weights": [0.5, 0.5]},
                          "1": {"experts": [3, 1], "weights": [0.75, 0.25]}}} for t in range(5)]
    src = tmp_path / "r.json"
    src.write_text(json.dumps({"meta": {"model_id": "Tiny", "num_moe_layers": 2, "num_experts": 4, "top_k": 2},
                               "routes": routes}))
    trace = tmp_path / "t.trace.jsonl"
    import_trace("moe-ocs", src, trace)
    out = tmp_path / "p.json"
    r = CliRunner().invoke(main, ["profile", "from-trace", str(trace), str(trace), "-o", str(out), "--half-life",
                                  "1e12"])
    assert r.exit_code == 0, r.output
    p = ActivationProfile.load(out)
    assert (p.model, p.fingerprint, p.workload, p.num_layers, p.num_experts) == ("Tiny", "shape-2x4", "t", 2, 4)
    # per trace: calls = the 2-token prefill, then tokens 2, 3, 4 alone: 4 calls, 5 tokens
    assert p.tokens_total == 10
    assert np.allclose(p.counts, 2 * np.array([[3, 2, 4, 0], [0, 4, 0, 4]]))
    assert set(p.curve) >= {"lru", "activation"}
    with pytest.raises(MlxmoeError, match="pass --force"):
        p.check_model("0123456789abcdef", 2, 4)
    p.check_model("0123456789abcdef", 2, 4, force=True)
    with pytest.raises(MlxmoeError, match="2 layers x 4 experts, the model 3 x 4"):
        p.check_model("0123456789abcdef", 3, 4, force=True)
    # a trace of another shape is refused, naming both
    other = tmp_path / "o.trace.jsonl"
    other.write_text(json.dumps({"format": "mlxmoe.trace/1", "num_layers": 3, "num_experts": 4, "top_k": 2}) + "\n"
                     + json.dumps({"s": 0, "t": 0, "l": 0, "e": [1]}) + "\n")
    r = CliRunner().invoke(main, ["profile", "from-trace", str(trace), str(other), "-o", str(out)],
                           standalone_mode=False)
    assert isinstance(r.exception, MlxmoeError) and "o.trace.jsonl is of another model" in str(r.exception)


def test_replay_with_profile_matches_a_run_loaded_with_it(checkpoint, tmp_path):
    """A profile built from one run's trace, given to a new load (pre-warm finished before
    the first token, prefetch off): the run's hits are those of `trace replay --profile`
    on its trace, for every policy. A recorded trace carries its model's fingerprint, so
    the profile loads without --force."""
    import mlxmoe
    from mlxmoe.caching.policies import ONLINE

    path = checkpoint("qwen3_moe", quant="4bit", config_overrides={"num_hidden_layers": 2})
    first = tmp_path / "first.trace.jsonl"
    model, tokenizer = mlxmoe.load(str(path), cache_experts=4, prefetch=0, prewarm=False, trace_out=str(first))
    mlxmoe.generate(model, tokenizer, "The quick brown fox jumps over the lazy dog", max_tokens=12)
    model.expert_cache.close()
    profile_path = tmp_path / "p.json"
    r = CliRunner().invoke(main, ["profile", "from-trace", str(first), "-o", str(profile_path), "--no-curve"])
    assert r.exit_code == 0, r.output
    prior = ActivationProfile.load(profile_path)
    assert len(prior.fingerprint) == 16 and prior.fingerprint == read_trace(first)[0]["fingerprint"]
    differs = []
    for policy in ONLINE:
        trace = tmp_path / f"{policy}.trace.jsonl"
        model, tokenizer = mlxmoe.load(str(path), cache_experts=6, policy=policy, prefetch=0,
                                       profile=str(profile_path), trace_out=str(trace))
        assert model.expert_cache.prewarm_done(timeout=60)
        for prompt in ("Hello there, how are you", "A lazy dog"):
            mlxmoe.generate(model, tokenizer, prompt, max_tokens=8)
        stats = model.expert_cache.stats()
        model.expert_cache.close()
        header, records = read_trace(trace)
        warm = replay(header, records, policy, 6, profile=prior)
        assert (warm["hits"], warm["accesses"]) == (stats["hits"], stats["hits"] + stats["misses"]), policy
        differs.append(replay(header, records, policy, 6)["hits"] != warm["hits"])
    assert all(differs)  # the profile changed every policy's hits (not ignored by the replay)


def test_imported_profile_on_a_real_checkpoint(checkpoint, tmp_path):
    """An imported trace's profile loads on a checkpoint of its shape only with --force;
    built with --model naming the checkpoint it takes its fingerprint and expert size, loads
    without --force, and `profile show --budget` says what a budget buys. A checkpoint of
    another shape is refused."""
    import mlxmoe
    from mlxmoe.loader import open_checkpoint

    path = checkpoint("qwen3_moe", quant="4bit", config_overrides={"num_hidden_layers": 2})
    ckpt = open_checkpoint(str(path))
    L, E, k = ckpt.num_layers, ckpt.num_experts, ckpt.top_k
    ckpt.store.close()
    rng = np.random.default_rng(2)
    rows = [{"type": "route", "req_id": f"q{q}", "token_idx": t, "layer": l,
             "topk_ids": rng.choice(E, k, replace=False).tolist(), "topk_weights": [1 / k] * k}
            for q in range(2) for t in range(12) for l in range(L)]
    trace = tmp_path / "served.trace.jsonl"
    import_trace("vllm", write_jsonl(tmp_path / "routes.jsonl", rows), trace, num_experts=E)
    bare, named = tmp_path / "bare.json", tmp_path / "named.json"
    for out, extra in ((bare, []), (named, ["--model", str(path)])):
        r = CliRunner().invoke(main, ["profile", "from-trace", str(trace), "-o", str(out)] + extra)
        assert r.exit_code == 0, r.output
    with pytest.raises(MlxmoeError, match="pass --force"):
        mlxmoe.load(str(path), cache_experts=4, profile=str(bare))
    model, _ = mlxmoe.load(str(path), cache_experts=4, profile=str(bare), force_profile=True, prefetch=0)
    model.expert_cache.close()
    model, _ = mlxmoe.load(str(path), cache_experts=4, profile=str(named), prefetch=0)
    live = model.expert_cache.profile
    model.expert_cache.close()
    p = ActivationProfile.load(named)
    assert (p.fingerprint, p.expert_bytes, p.resident_bytes) == (live.fingerprint, live.expert_bytes,
                                                                  live.resident_bytes)
    budget = p.resident_bytes + 10 * p.expert_bytes
    r = CliRunner().invoke(main, ["profile", "show", str(named), "--budget", str(budget), "--json"])
    shown = json.loads(r.stdout)["budget"]
    assert shown["cache_experts"] == 10 and set(shown["predicted_hit_rate"]) >= {"lru", "activation"}
    other = checkpoint("qwen3_moe", quant="4bit", config_overrides={"num_hidden_layers": 3})
    r = CliRunner().invoke(main, ["profile", "from-trace", str(trace), "-o", str(tmp_path / "x.json"), "--model",
                                  str(other)], standalone_mode=False)
    assert isinstance(r.exception, MlxmoeError) and f"{L} layers x {E} experts, the model 3 x {E}" in str(r.exception)
