"""Speculative decoding through the expert cache: greedy tokens with a draft model or with
n-gram drafting equal stock mlx-lm's greedy tokens, with every expert resident and streamed
(down to a cache whose multi-token verify steps miss); the draft model within the budget or
refused; a draft model of another tokenizer refused; the CLI's and the server's options."""

import json

import re

import mlx_lm
import numpy as np
from mlx.utils import tree_flatten
import pytest

import mlxmoe
import synthetic
from conftest import run_cli
from mlxmoe.api import model_info
from mlxmoe.backend import detect
from mlxmoe import drafting
from mlxmoe.drafting import FIRST_WEIGH, MEASURE_TOKENS, OFF_TOKENS, PROBE_TOKENS, WEIGH_STEPS, Lookup, ngram_draft

TEXT = "the cat sat on the mat and then the dog came to see the cat"
REPEAT = f"Repeat this text: {TEXT}. Again: {TEXT}. Again:"  # a prompt the output repeats (n-gram drafts)
FREE = "Il gatto"
TOKENS = 40

_reference = {}


def reference(path, prompt):
    """Stock mlx-lm's greedy tokens (mlxmoe's dtype policy: float32 on CPU)."""
    if (path, prompt) not in _reference:
        model, tokenizer = mlx_lm.load(str(path))
        detect().apply_dtype_policy(model)
        _reference[path, prompt] = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt,
                                                                            max_tokens=TOKENS)]
    return _reference[path, prompt]


def tokens(model, tokenizer, prompt, **kw):
    return [r.token for r in mlxmoe.stream_generate(model, tokenizer, prompt, max_tokens=TOKENS, **kw)]


def by_acceptance(model):
    """`model`'s n-gram drafting weighed by acceptance alone, as if a plain step took forever
    (the tests that count drafts do not depend on this CPU's step times)."""
    model.expert_runtime.ngram_switch.plain = float("inf")


@pytest.fixture(scope="module")
def paths(checkpoint):
    main = checkpoint("qwen3_moe")
    small = checkpoint("qwen3_moe", seed=1, config_overrides={"num_hidden_layers": 1})  # another model: rejections
    return main, small


@pytest.mark.parametrize("cache_experts", [None, 12, 2], ids=["all resident", "half", "minimum"])
def test_draft_model_greedy_equals_mlx_lm(paths, cache_experts):
    main, small = paths
    kw = {} if cache_experts is None else {"cache_experts": cache_experts}
    for draft in (small, main):  # a draft mostly wrong, and one mostly right (the model itself)
        model, tokenizer = mlxmoe.load(str(main), draft_model=str(draft), **kw)
        runtime = model.expert_runtime
        for prompt in (REPEAT, FREE):
            want = reference(main, prompt)
            assert tokens(model, tokenizer, prompt, draft_model=runtime.draft_model, num_draft_tokens=3) == want
        stats = model.expert_cache.stats()
        assert stats["drafted"] > 0 and 0 <= stats["accepted"] <= stats["drafted"]
        if draft == main:
            assert stats["acceptance"] > 0.5, stats
        if cache_experts is not None:
            assert stats["misses"] > 0 and stats["cache_experts"] == cache_experts
        runtime.close()


@pytest.mark.parametrize("cache_experts", [None, 12, 2], ids=["all resident", "half", "minimum"])
def test_ngram_greedy_equals_mlx_lm_and_accepts_on_a_repeating_prompt(paths, cache_experts):
    main, _ = paths
    model, tokenizer = mlxmoe.load(str(main), **({} if cache_experts is None else {"cache_experts": cache_experts}))
    by_acceptance(model)
    assert tokens(model, tokenizer, REPEAT, draft_model="ngram") == reference(main, REPEAT)
    stats = model.expert_cache.stats()
    assert stats["drafted"] > 0 and stats["accepted"] > 0, stats
    assert tokens(model, tokenizer, FREE, draft_model="ngram", num_draft_tokens=2) == reference(main, FREE)
    # a logits processor sees the whole sequence, as without drafts
    processors = mlx_lm.sample_utils.make_logits_processors(repetition_penalty=1.3, repetition_context_size=16)
    assert tokens(model, tokenizer, REPEAT, draft_model="ngram", logits_processors=processors) == \
        tokens(model, tokenizer, REPEAT, logits_processors=processors)
    model.expert_runtime.close()


def test_a_multi_token_verify_step_that_misses_is_exact(paths):
    """At the minimum cache, steps that verify several tokens miss (read experts) and give
    stock mlx-lm's tokens; the KV caches trimmed after rejections, a second generation on a
    carried prompt cache gives the same tokens as without drafts."""
    main, small = paths
    model, tokenizer = mlxmoe.load(str(main), cache_experts=2, draft_model=str(small))
    cache = model.expert_cache
    calls = []
    cache.watch(lambda call: calls.append((call.tokens, call.position)))
    prompt = tokenizer.encode(REPEAT)
    misses = cache.counters.misses
    assert tokens(model, tokenizer, REPEAT, draft_model=model.expert_runtime.draft_model) == reference(main, REPEAT)
    assert cache.counters.misses > misses
    assert any(n > 1 and position >= len(prompt) for n, position in calls), "no multi-token verify step"

    from mlx_lm.models.cache import make_prompt_cache

    def two_turns(**kw):
        carried = make_prompt_cache(model) + (make_prompt_cache(kw["draft_model"]) if kw else [])
        out = [tokens(model, tokenizer, prompt, prompt_cache=carried, **kw)]
        out.append(tokens(model, tokenizer, tokenizer.encode(" and again"), prompt_cache=carried, **kw))
        return out

    assert two_turns(draft_model=model.expert_runtime.draft_model) == two_turns()
    model.expert_runtime.close()


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_multi_token_steps_are_verified_in_one_pass(paths, monkeypatch, draft):
    """Where the cache holds a step's experts at once, a speculative step's tokens go through
    the verified path together (no wait per layer), misses read (and replayed, or read in place
    at a held Direct layer): stock mlx-lm's
    tokens, also on a second turn over a carried prompt cache; the live profile learns them."""
    from mlxmoe.caching import verify

    main, small = paths
    model, tokenizer = mlxmoe.load(str(main), cache_experts=12, draft_model=str(small) if draft == "model" else None)
    by_acceptance(model)
    cache = model.expert_cache
    cache.verifier.switch.weigh = lambda *a: False  # on, whatever replays cost against a wait here
    checks = []  # (tokens of the step, whether it read a miss: a replay's, or a held layer's read in place)
    check = verify.Verifier._check

    def counted(self, until=None, **kw):
        misses = cache.counters.misses
        missed = check(self, until, **kw)
        checks.append((self.tokens, missed is not None or cache.counters.misses > misses))
        return missed

    monkeypatch.setattr(verify.Verifier, "_check", counted)
    seen = []  # what the observers (a trace) learn: each token's experts and distribution
    cache.watch(seen.append)
    kw = {"draft_model": model.expert_runtime.draft_model if draft == "model" else "ngram"}
    assert tokens(model, tokenizer, REPEAT, **kw) == reference(main, REPEAT)
    assert any(c.tokens > 1 and c.rows.shape[0] == c.probs.shape[0] == c.tokens for c in seen if c.probs is not None)
    several = [m for n, m in checks if n > 1]
    assert several and any(several), f"no multi-token step verified, or none missed: {checks}"
    assert cache.stats()["verified_tokens"] > TOKENS
    assert cache.profile.tokens_total > TOKENS

    from mlx_lm.models.cache import make_prompt_cache

    def two_turns(**k):
        carried = make_prompt_cache(model) + (make_prompt_cache(k["draft_model"]) if draft == "model" and k else [])
        out = [tokens(model, tokenizer, tokenizer.encode(REPEAT), prompt_cache=carried, **k)]
        out.append(tokens(model, tokenizer, tokenizer.encode(" and again"), prompt_cache=carried, **k))
        return out

    assert two_turns(**kw) == two_turns()
    model.expert_runtime.close()


def test_ngram_switching_to_drafts_wastes_no_forward(paths, monkeypatch):
    """Where a draft comes during plain steps, the token generate_step computed ahead is the
    next token (not computed again): the model processes the prompt, each generated token
    but the last, and the drafts it rejected, and at most the one token a generation
    computes ahead at its end."""
    main, _ = paths
    model, tokenizer = mlxmoe.load(str(main), cache_experts=12)
    by_acceptance(model)
    cache = model.expert_cache
    first = []  # tokens of each call of the first MoE layer
    cache.watch(lambda call: first.append(call.tokens) if call.layer == 0 else None)
    runs = []  # generate_step runs: each ended where a draft came, or with the generation
    plain = drafting.generate_step
    monkeypatch.setattr(drafting, "generate_step", lambda *a, **k: runs.append(1) or plain(*a, **k))
    got = tokens(model, tokenizer, REPEAT, draft_model="ngram")
    assert got == reference(main, REPEAT)
    stats = cache.stats()
    rejected = stats["drafted"] - stats["accepted"]
    assert stats["accepted"] > 0 and rejected > 0 and len(runs) >= 2, (stats, runs)  # (one run: no switch back)
    needed = len(tokenizer.encode(REPEAT)) + len(got) - 1 + rejected
    assert needed <= sum(first) <= needed + 1, (sum(first), needed, stats)
    model.expert_runtime.close()


def test_draft_model_counted_in_the_budget_or_refused(paths):
    main, small = paths
    budget = model_info(str(main))["all_resident_budget"] + (2 << 20)  # every expert, and 2 MB: less than the draft takes
    model, _ = mlxmoe.load(str(main), memory_budget=budget)
    alone = model.expert_runtime.plan
    model.expert_runtime.close()
    model, _ = mlxmoe.load(str(main), memory_budget=budget, draft_model=str(small))
    plan = model.expert_runtime.plan
    draft = model.expert_runtime.draft_model
    weights = sum(v.nbytes for _, v in tree_flatten(draft.parameters()))
    assert plan.resident > alone.resident + weights  # its weights and its KV cache
    assert plan.cache_experts < alone.cache_experts  # the cache gave them room
    model.expert_runtime.close()
    minimum = model_info(str(main))["minimum_budget"]
    mlxmoe.load(str(main), memory_budget=minimum)[0].expert_runtime.close()  # fits alone
    with pytest.raises(mlxmoe.MlxmoeError, match=rf"below the minimum.*the draft model {re.escape(str(small))} needs "
                       r"[0-9.]+ [KM]B"):
        mlxmoe.load(str(main), memory_budget=minimum, draft_model=str(small))


def test_a_draft_model_of_another_tokenizer_or_outside_the_budget_is_refused(tmp_path, paths):
    main, _ = paths
    tok = synthetic.train_tokenizer(tmp_path / "tok", vocab_size=300)
    other = synthetic.build_checkpoint(tmp_path / "other", "qwen3_moe", tokenizer_dir=tok)
    with pytest.raises(mlxmoe.MlxmoeError, match=rf"draft model {re.escape(str(other))}: its tokenizer differs"):
        mlxmoe.load(str(main), draft_model=str(other))
    with pytest.raises(mlxmoe.MlxmoeError, match=rf"draft model {re.escape(str(tmp_path / 'missing'))}: mlx-lm cannot"):
        mlxmoe.load(str(main), draft_model=str(tmp_path / "missing"))
    model, tokenizer = mlxmoe.load(str(main), cache_experts=4)
    stock, _ = mlx_lm.load(str(main))
    with pytest.raises(mlxmoe.MlxmoeError, match="draft_model: .*mlxmoe.load"):  # a model the budget does not hold
        tokens(model, tokenizer, FREE, draft_model=stock)
    with pytest.raises(mlxmoe.MlxmoeError, match="num_draft_tokens -1"):
        tokens(model, tokenizer, FREE, draft_model="ngram", num_draft_tokens=-1)
    model.expert_runtime.close()


def test_ngram_lookup_and_its_switch():
    seq = np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert ngram_draft(seq, len(seq), 3) == [9, 2, 6]  # the latest match of the last 2 (no earlier 3-gram)
    assert ngram_draft(np.array([1, 2, 3, 1, 2, 3]), 6, 5) == [1, 2, 3]  # 3-gram first, up to the end
    assert ngram_draft(np.array([1, 2, 3]), 3, 5) == []
    assert ngram_draft(np.array([5, 1, 7, 2, 5]), 5, 3) == []  # one token alone matching: no draft
    lookup = Lookup([1, 2, 3, 1, 2, 3], most=4)
    assert lookup.propose() == [1, 2, 3][:PROBE_TOKENS]  # the first window probes with short drafts
    for _ in range(FIRST_WEIGH):  # steps whose drafts were all rejected: off for a while
        lookup.add(4)
        lookup.weigh(PROBE_TOKENS, 0)
    lookup.extend([1, 2, 3])
    assert lookup.propose() == []
    for _ in range(OFF_TOKENS - 3):
        lookup.add(3)
    assert (lookup.switch.pause, lookup.switch.left) == (2 * OFF_TOKENS, 3)  # a longer pause at the next turn off; 3 tokens left of this one
    after = Lookup([1, 2, 3, 1, 2, 3], most=4, switch=lookup.switch)  # the model's next generation: still off
    assert after.propose() == []
    for _ in range(3):
        after.add(3)
    after.extend([1, 2, 3])
    assert len(after.propose()) == PROBE_TOKENS and (lookup.switch.pause, lookup.switch.left) == (2 * OFF_TOKENS, 0)  # on again
    after.weigh(2, 2)
    after.weigh(2, 1)  # a good window: the pause back to its shortest, drafts at their longest
    assert (after.switch.pause, after.switch.left) == (OFF_TOKENS, 0) and len(after.propose()) == 4


def test_ngram_switch_weighs_drafted_steps_against_plain_ones():
    """Drafts all accepted, yet drafted steps that give fewer tokens a second than plain steps
    (a step of several tokens costing several) pause drafting; faster ones keep it on. Until a
    plain step is timed, a good timed window is followed by a few plain steps to time."""
    def drafting(lookup, seconds):  # a window of steps of 4 drafts, all accepted, each 5 tokens in `seconds`
        for _ in range(FIRST_WEIGH if lookup.first else WEIGH_STEPS):
            lookup.extend([1, 2, 3, 4])
            lookup.add(5)
            lookup.weigh(4, 4, seconds, 5)

    lookup = Lookup([1, 2, 3, 4, 5] * 3, most=4)
    drafting(lookup, 0.05)  # no plain step timed yet: on, after MEASURE_TOKENS plain steps
    assert not lookup.first and lookup.propose() == []
    for token in range(1, MEASURE_TOKENS + 1):
        lookup.plain(0.02)
        lookup.add(token)
    assert len(lookup.propose()) == 4
    drafting(lookup, 0.05)  # 0.01 s a token against 0.02: on
    assert len(lookup.propose()) == 4
    drafting(lookup, 0.15)  # 0.03 s a token: off for OFF_TOKENS
    assert lookup.first and lookup.propose() == [] and (lookup.switch.pause, lookup.switch.left) == (2 * OFF_TOKENS, OFF_TOKENS)


def test_ngram_switches_itself_off_where_drafts_fail(paths, monkeypatch):
    """Drafts that are always wrong: the output is still greedy's, and after the first
    weighing drafting pauses, ever longer (also into the model's next generation), so few
    steps carry drafts."""
    main, _ = paths
    model, tokenizer = mlxmoe.load(str(main), cache_experts=12)
    want = [r.token for r in mlxmoe.stream_generate(model, tokenizer, FREE, max_tokens=120)]
    wrong = next(t for t in range(len(synthetic.SPECIAL_TOKENS), 400) if t not in want)
    monkeypatch.setattr(drafting, "ngram_draft", lambda seq, n, most: [wrong] * most)
    got = [r.token for r in mlxmoe.stream_generate(model, tokenizer, FREE, max_tokens=120, draft_model="ngram")]
    assert got == want
    stats = model.expert_cache.stats()
    steps = stats["drafted"] // PROBE_TOKENS  # (every window a probe: none is good)
    assert stats["accepted"] == 0 and 0 < steps <= 4 * FIRST_WEIGH, stats  # off 16, 32, 64 tokens between tries
    # the next generation on the model goes on with what is left of the pause, then tries
    # FIRST_WEIGH steps at most before a pause longer than its 120 tokens
    left = model.expert_runtime.ngram_switch.left
    model.expert_cache.reset_stats()
    assert [r.token for r in mlxmoe.stream_generate(model, tokenizer, FREE, max_tokens=120, draft_model="ngram")] == want
    assert model.expert_cache.stats()["drafted"] == (0 if left >= 119 else FIRST_WEIGH * PROBE_TOKENS), left
    model.expert_runtime.close()


def test_cli_generate_and_chat_with_drafts(paths, tmp_path):
    main, small = paths
    args = ["generate", "--model", main, "--raw", "-p", REPEAT, "--max-tokens", TOKENS, "--cache-experts", 12]
    code, plain, _ = run_cli(*args)
    assert code == 0
    stats = tmp_path / "stats.json"
    code, out, err = run_cli(*args, "--draft", "ngram", "--num-draft", 4, "--stats-json", stats)
    assert code == 0 and out == plain
    s = json.loads(stats.read_text())
    assert s["drafted"] > 0 and s["accepted"] > 0
    assert f"{s['accepted']} of {s['drafted']} drafted tokens accepted" in err
    code, out, err = run_cli(*args, "--draft-model", small, "--num-draft-tokens", 2)
    assert code == 0 and out == plain and "drafted tokens accepted" in err
    code, _, err = run_cli(*args, "--draft-model", small, "--draft", "ngram")
    assert code == 2 and "--draft-model and --draft exclude each other" in err
    code, _, err = run_cli(*args, "--draft-model", small, "--max-kv-size", 64)
    assert code == 2 and "--max-kv-size" in err


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_serve_with_drafts_answers_as_without(draft):
    """`serve --draft ngram` or `--draft-model` (the demo drafting for itself): each answer
    equals mlxmoe.generate's greedy one; a request naming another draft model is refused."""
    pytest.importorskip("openai")
    from test_server import DEMO, Server

    args = ["--draft", "ngram"] if draft == "ngram" else ["--draft-model", DEMO, "--num-draft-tokens", 2]
    server = Server("--memory-budget", "80MB", *args)
    try:
        model, tokenizer = mlxmoe.load(str(DEMO), memory_budget="80MB")
        for prompt in (f"Repeat: {TEXT}. Repeat: {TEXT}. Repeat:", "Il gatto"):
            want = mlxmoe.generate(model, tokenizer, prompt, max_tokens=24)
            r = server.client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0)
            assert r.choices[0].text == want
        status, _, stats = server.json("GET", "/v1/mlxmoe/stats")
        assert status == 200 and stats["drafted"] > 0 and stats["accepted"] > 0, stats
        status, _, body = server.json("POST", "/v1/completions", {"prompt": "x", "draft_model": "other"})
        assert status == 400 and "draft_model" in json.dumps(body)
    finally:
        assert server.stop() == 0


def test_cli_chat_with_drafts_answers_as_without(paths):
    """Two turns (the KV cache carried, with the draft model's beside it): the same replies
    with a draft model, with n-gram drafts and without; the reply's line counts the drafts."""
    from click.testing import CliRunner

    from mlxmoe.cli import main as cli_main

    main, small = paths
    chat = f"{REPEAT}\nsay it again: {TEXT}\n/quit\n"
    args = ["chat", "--model", str(main), "--max-tokens", "24", "--cache-experts", "8"]
    runs = [CliRunner().invoke(cli_main, args + extra, input=chat)
            for extra in ([], ["--draft", "ngram"], ["--draft-model", str(small), "--num-draft", "2"])]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    assert runs[0].stdout == runs[1].stdout == runs[2].stdout
    lines = [l for l in runs[2].stderr.splitlines() if "expert hit rate" in l]
    assert len(lines) == 2 and all(re.search(r"\d+ of \d+ drafted tokens accepted", l) for l in lines), lines


def test_drafts_are_refused_across_ranks():
    class Ranks:  # an mx.distributed group's size() is all the check reads
        def size(self):
            return 2

    with pytest.raises(mlxmoe.MlxmoeError, match="draft_model: .* not across ranks"):
        mlxmoe.LoadOptions(draft_model="draft", group=Ranks()).check()


def test_sliding_window_model_drafts_until_its_cache_wraps(checkpoint):
    """gpt_oss's rotating KV caches: n-gram drafts stop before a cache would wrap (a wrapped
    cache cannot take rejected drafts back), so 100 tokens past a 64-token window stay
    greedy's; a draft model, whose mlx-lm loop would keep rejected drafts there, is refused."""
    path = checkpoint("gpt_oss", config_overrides={"sliding_window": 64})
    prompt = "the cat sat on the mat the cat sat"
    stock, tokenizer = mlx_lm.load(str(path))
    detect().apply_dtype_policy(stock)
    want = [r.token for r in mlx_lm.stream_generate(stock, tokenizer, prompt, max_tokens=100)]
    model, tokenizer = mlxmoe.load(str(path), cache_experts=4)
    got = [r.token for r in mlxmoe.stream_generate(model, tokenizer, prompt, max_tokens=100, draft_model="ngram")]
    assert got == want and model.expert_cache.stats()["drafted"] > 0
    model.expert_runtime.close()
    with pytest.raises(mlxmoe.MlxmoeError, match="rotating .* KV cache"):
        mlxmoe.load(str(path), draft_model=str(path))
    model, tokenizer = mlxmoe.load(str(checkpoint("qwen3_moe")), draft_model=str(checkpoint("qwen3_moe")))
    with pytest.raises(mlxmoe.MlxmoeError, match="rotating .* KV cache"):  # --max-kv-size: a rotating cache
        tokens(model, tokenizer, prompt, draft_model=model.expert_runtime.draft_model, max_kv_size=64)
    model.expert_runtime.close()


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_a_bench_model_answering_as_given_text_gives_it_with_drafts(paths, tmp_path, draft):
    """bench/answers.py: a random-weights model whose logits follow a given sequence answers
    its continuation, with drafts as without (the drafts accepted where they match it), its
    experts still streamed; a chat recording's ids are mapped onto the vocabulary one to one."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parent.parent / "bench")
    sys.path.insert(0, bench)
    try:
        import answers
    finally:
        sys.path.remove(bench)
    main, _ = paths
    model, tokenizer = mlxmoe.load(str(main), cache_experts=12, **({"draft_model": str(main)} if draft == "model" else {}))
    runtime = model.expert_runtime
    by_acceptance(model)
    state = {}
    for m in (model, runtime.draft_model) if draft == "model" else (model,):
        answers.answer_as(m, state)
    body = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = body + body[:3]
    state["sequence"] = whole = prompt + body[3:] + body  # (its continuation repeats the text)
    kw = {"draft_model": "ngram"} if draft == "ngram" else {"draft_model": runtime.draft_model}
    plain = [r.token for r in mlxmoe.stream_generate(model, tokenizer, prompt, max_tokens=len(whole) - len(prompt))]
    assert plain == whole[len(prompt):]
    runtime.cache.reset_stats()
    drafted = [r.token for r in mlxmoe.stream_generate(model, tokenizer, prompt, max_tokens=len(plain), **kw)]
    stats = runtime.cache.stats()
    assert drafted == plain and stats["accepted"] > len(plain) // 3 and stats["misses"] > 0
    runtime.close()

    recorded = tmp_path / answers.CHAT_ANSWERS[0]
    recorded.parent.mkdir(parents=True)
    recorded.write_text(json.dumps({"prompt_tokens": [151644, 7, 151644], "generated_tokens": [99, 7, 99, 5]}))
    (got,) = answers.sequences(tokenizer, "chat", 1, tmp_path, vocab=400)
    first = answers.FIRST_ID
    assert got == ([first, first + 1, first], [first, first + 1, first, first + 2, first + 1, first + 2, first + 3])
    with pytest.raises(SystemExit, match="4 distinct tokens, more than the model's vocabulary of 12"):
        answers.sequences(tokenizer, "chat", 1, tmp_path, vocab=12)
