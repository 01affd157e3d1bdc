"""Exact eviction order of each policy on small hand-made sequences, Belady on a sequence
with a known optimum, and the replay simulator's output."""

import json

import numpy as np
import pytest

from mlxmoe.caching.cache import Residency
from mlxmoe.errors import MlxmoeError
from mlxmoe.caching.policies import DEFAULT_POLICY, make_policy
from mlxmoe.workload.curves import lru_curve
from mlxmoe.workload.trace import read_trace, replay, replay_all, steps


def run(policy, capacity, sequence, layers=1, experts=16, **kw):
    """sequence: steps of (layer, [experts]); a new token starts at each layer-0 step.
    Returns the evicted keys in order and the Residency."""
    flat = [(l, e) for l, es in sequence for e in es]
    if policy == "belady":
        kw["future"] = flat
    r = Residency(capacity, make_policy(policy, capacity, layers, experts, **kw))
    evicted = []
    r.evicted = evicted.append
    for layer, es in sequence:
        if layer == 0:
            r.tick(1)
        r.access(layer, es)
    return evicted, r


def single(*experts):
    return [(0, [e]) for e in experts]


def test_lru_order():
    evicted, r = run("lru", 2, single(1, 2, 1, 3, 2, 4))
    assert evicted == [(0, 2), (0, 1), (0, 3)]
    assert r.counters.hits == 1


def test_lfu_keeps_frequent_and_forgets_with_decay():
    evicted, _ = run("lfu", 2, single(1, 1, 2, 3))
    assert evicted == [(0, 2)]  # 1 was used twice
    # with a half-life of one token, 1's two old uses are worth less than 2's recent one
    evicted, _ = run("lfu", 2, single(1, 1, 2, 2, 2, 3), half_life=0.5)
    assert evicted == [(0, 1)]
    # ties go to the least recently inserted
    evicted, _ = run("lfu", 2, single(1, 2, 3))
    assert evicted == [(0, 1)]


def test_slru_segments_and_frequency_aware_victim():
    # 4 slots, protected segment of 2, victim among the 2 least recent probationary keys
    seq = single(1, 2, 3, 4, 1, 2, 3, 5)
    evicted, r = run("slru", 4, seq, protected_share=0.5, window=2)
    # hits on 1, 2, 3 promote them; 3's promotion demotes 1 (least recent protected) to
    # probation, which is then [4, 1]; 1 has 2 uses, 4 one: 4 goes
    assert evicted == [(0, 4)]
    assert list(r.policy.protected) == [(0, 2), (0, 3)]
    assert list(r.policy.probation) == [(0, 1), (0, 5)]


def test_slru_pinned_keys_stay():
    seq = single(9, 1, 2, 3, 4)
    evicted, r = run("slru", 2, seq, pinned={(0, 9)})
    assert (0, 9) not in evicted and (0, 9) in r.slot_of
    assert evicted == [(0, 1), (0, 2), (0, 3)]


def test_s3fifo_filters_one_hit_wonders():
    # 10 slots: small FIFO of 1. A key seen once leaves through small (into the ghost);
    # when it comes back it goes to main.
    seq = single(1, 2, 3)
    evicted, r = run("s3fifo", 2, seq)
    assert evicted == [(0, 1)]
    assert (0, 1) in r.policy.ghost
    # until the cache is full everything waits in small; then the head of small is
    # promoted to main if it was hit there (1), evicted to the ghost if not (2)
    evicted, r = run("s3fifo", 10, single(*range(1, 11), 1, 11, 12))
    assert evicted == [(0, 2), (0, 3)]
    assert (0, 1) in r.policy.main and (0, 2) in r.policy.ghost
    # a key that comes back from the ghost goes straight to main
    evicted, r = run("s3fifo", 10, single(*range(1, 11), 11, 1, 12))
    assert evicted[0] == (0, 1) and (0, 1) in r.policy.main


def test_layer_lru_evicts_within_the_layer_at_its_share():
    """Two layers, 4 slots: 2 each. Layer 0 at its share evicts its own least recent, even
    where a key of layer 1 is older overall (global LRU would take layer 1's)."""
    seq = [(0, [1]), (1, [1]), (1, [2]), (0, [2]), (0, [1]), (0, [3])]
    evicted, r = run("layer-lru", 4, seq, layers=2)
    assert evicted == [(0, 2)]
    evicted, _ = run("lru", 4, seq, layers=2)
    assert evicted == [(1, 1)]


def test_layer_split_takes_a_slot_from_the_layer_furthest_over_its_share():
    """Layer 1 filled 3 of the 4 slots while layer 0 had one: layer 0, under its share of 2,
    takes layer 1's least recent."""
    seq = [(1, [1]), (1, [2]), (1, [3]), (0, [1]), (0, [2])]
    evicted, _ = run("layer-lru", 4, seq, layers=2)
    assert evicted == [(1, 1)]


def test_layer_lfu_keeps_the_most_used_of_the_layer():
    seq = [(0, [1]), (0, [1]), (0, [2]), (1, [5]), (1, [6]), (0, [3])]
    evicted, _ = run("layer-lfu", 4, seq, layers=2)
    assert evicted == [(0, 2)]  # used once, where 1 was used twice


def test_lfuda_ages_out_what_was_popular_long_ago():
    """One layer, 2 slots. 1 is used three times (priority 3), then 2, 3, 4, 5, 6 churn:
    each victim raises the layer's age to its priority, so a newcomer's priority (1 + age)
    reaches 1's after two evictions and 1, the less recent of equals, goes; plain
    layer-LFU keeps 1 for good."""
    seq = single(1, 1, 1, 2, 3, 4, 5, 6)
    evicted, _ = run("lfuda", 2, seq)
    assert evicted == [(0, 2), (0, 3), (0, 1), (0, 4)]
    evicted, _ = run("layer-lfu", 2, seq)
    assert evicted == [(0, 2), (0, 3), (0, 4), (0, 5)]


def test_belady_known_optimum():
    # capacity 2 on a loop of 3: LRU never hits, the optimum hits 2 of 6
    seq = single(1, 2, 3, 1, 2, 3)
    _, lru = run("lru", 2, seq)
    evicted, opt = run("belady", 2, seq)
    assert lru.counters.hits == 0
    assert opt.counters.hits == 2
    assert evicted == [(0, 2), (0, 1)]  # evict the key used farthest in the future (or never)


def test_belady_is_offline_only():
    with pytest.raises(MlxmoeError, match="trace replay"):
        make_policy("belady", 4, 1, 16)


def test_activation_prefers_frequent_and_takes_the_prior():
    evicted, _ = run("activation", 2, single(1, 1, 1, 2, 3))
    assert evicted == [(0, 2)]
    # a prior that makes expert 7 the hottest seeds its frequency and long-run rate: it
    # survives a run of other experts, which it does not without the prior
    prior = np.zeros((1, 16))
    prior[0, 7] = 0.9
    for name in ("activation", DEFAULT_POLICY):
        evicted, r = run(name, 2, single(7, 1, 2, 3, 4), prior=prior)
        assert (0, 7) not in evicted and (0, 7) in r.slot_of
    assert run("activation", 2, single(7, 1, 2, 3, 4))[0][0] == (0, 7)


def test_activation_evicts_from_the_layer_just_run_on_ties():
    # two layers, equal histories: after layer 0 runs, its experts are next needed a
    # whole token later, layer 1's in one step; the victim comes from layer 0
    seq = [(0, [1]), (1, [1]), (0, [2])]
    evicted, _ = run("activation", 2, seq, layers=2)
    assert evicted == [(0, 1)]


def test_floor_keeps_a_layer_at_its_share():
    # 2 layers x 1 slot, top-1: layer 1 has used expert 3 at every token, so when it turns
    # to expert 1, `activation` expects 3 back sooner than layer 0's last expert and takes
    # layer 0's slot (layer 0 down to none); activation-floor keeps each layer at its share
    # and layer 1 pays for itself
    seq = [(0, [3]), (1, [3]), (0, [0]), (1, [3]), (0, [2]), (1, [1])]
    assert run("activation", 2, seq, layers=2, experts=4)[0] == [(0, 3), (0, 0), (0, 2)]
    assert run("activation-floor", 2, seq, layers=2, experts=4)[0] == [(0, 3), (0, 0), (1, 3)]


def stale_layer_steps(prefill=0):
    """2 layers x 4 slots (8 experts, top-2): layer 1 uses 2 and 3 once, then only 0 and 1;
    layer 0 cycles through three pairs. Steps (tokens to tick, layer, experts); with
    `prefill`, a call of that many tokens using 0-3 in both layers comes first."""
    seq = [(0, [0, 1]), (1, [0, 1]), (0, [0, 1]), (1, [2, 3])]
    seq += [step for t in range(6) for step in ((0, [[2, 3], [4, 5], [6, 7]][t % 3]), (1, [0, 1]))]
    head = [(prefill, 0, [0, 1, 2, 3]), (0, 1, [0, 1, 2, 3])] if prefill else []
    return head + [(int(layer == 0), layer, es) for layer, es in seq]


def run_steps(steps, capacity=8, layers=2, experts=8, **kw):
    """Evicted keys and the policy's layer floor after each step."""
    policy = make_policy(DEFAULT_POLICY, capacity, layers, experts, **kw)
    r = Residency(capacity, policy)
    evicted, floors = [], []
    r.evicted = evicted.append
    for tokens, layer, es in steps:
        if tokens:
            r.tick(tokens)
        r.access(layer, es)
        floors.append(policy.floor.floor)
    return evicted, floors


def test_floor_slack_lets_a_stale_layer_give_slots_down_to_its_floor():
    """On stale_layer_steps() (single-token calls only), a floor at the even share (slack 0)
    keeps layer 1's stale 2 and 3 and layer 0 thrashes in its own 4 slots; slack 0.5 (floor
    4 less one expert: 3) gives up 2 and keeps 3; the default's (one token's 2 experts less:
    2) gives up both."""
    own = [(0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (0, 7)]
    evicted = {slack: run_steps(stale_layer_steps(), **({} if slack is None else {"floor_slack": slack}))
               for slack in (None, 0, 0.5)}
    assert evicted[0][0] == own + [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert evicted[0.5][0] == own + [(1, 2), (0, 0), (0, 1), (0, 2)]
    assert evicted[None][0] == own + [(1, 2), (1, 3), (0, 0), (0, 1)]
    assert set(evicted[None][1][1:]) == {2}


def test_default_floor_follows_the_share_of_accesses_from_single_token_calls():
    """The same steps after a prefill call using 0-3 in both layers (8 accesses): the floor
    is the even share less one token's 2 experts x the single-token share of the accesses,
    rounded down: 4 while the prefill's are more than half of them, 3 from half on (8 of
    16; 2 would need them gone), so layer 1 gives up its stale 2 but keeps 3."""
    evicted, floors = run_steps(stale_layer_steps(prefill=4))
    # before a single-token call top_k is 1 (4 - 1); then 2 and 4 single accesses against
    # the prefill's 8 (4), from the third token 8 of 16 and more (3)
    assert floors == [3, 3, 4, 4, 4, 4] + [3] * 12
    assert evicted == [(0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (0, 7), (1, 2), (0, 0), (0, 1), (0, 5)]
    assert run_steps(stale_layer_steps(prefill=4), floor_slack=0)[1] == [4] * 18


def test_default_keeps_the_last_visit_then_the_most_used():
    """1 layer of 5 experts, 3 slots, one expert a token: when 0 comes, 4 (4 uses, the last 4 tokens ago),
    3 (3 uses, 3 tokens ago) and 2 (2 uses, both just now) are resident. Per-layer LRU evicts
    4, per-layer LFU and `activation` evict 2; the default keeps 2 (used at the layer's last
    visit, so likely at the next) and of the others evicts 3, the rarer in the long run."""
    seq = single(4, 4, 4, 3, 3, 4, 3, 2, 2, 0)
    evicted = {p: run(p, 3, seq, experts=5)[0] for p in (DEFAULT_POLICY, "layer-lru", "layer-lfu", "activation")}
    assert evicted == {DEFAULT_POLICY: [(0, 3)], "layer-lru": [(0, 4)], "layer-lfu": [(0, 2)], "activation": [(0, 2)]}


def test_never_below_layer_lru_at_one_token_per_layer():
    """Where the cache holds exactly one token's experts per layer, keeping each layer's
    last token (per-layer LRU) is what a policy must not fall below; plain `activation`
    does on this sequence (slots wander to the layers whose routing it judges steadier)."""
    rng = np.random.default_rng(3)
    L, E, k = 4, 8, 2
    seq = []
    for t in range(300):
        for layer in range(L):
            # layer 0 repeats its last pair half of the time, the others are fresh each token
            if layer == 0 and t and rng.random() < 0.5:
                seq.append(seq[-L])
            else:
                seq.append((layer, sorted(rng.choice(E, k, replace=False).tolist())))
    hits = {p: run(p, L * k, seq, layers=L, experts=E)[1].counters.hits
            for p in ("layer-lru", "activation", DEFAULT_POLICY)}
    assert hits[DEFAULT_POLICY] >= hits["layer-lru"], hits
    assert hits["activation"] < hits["layer-lru"], hits  # the case is one that matters


@pytest.mark.parametrize("name", ["lru", "lfu", "slru", "s3fifo", "layer-lru", "layer-lfu", "lfuda", "activation",
                                  "activation-floor"])
def test_never_evicts_what_the_layer_needs(name):
    rng = np.random.default_rng(0)
    seq = [(l, sorted(rng.choice(16, 4, replace=False).tolist())) for _ in range(50) for l in range(3)]
    evicted, r = run(name, 4, seq, layers=3)
    assert r.counters.hits + r.counters.misses == 50 * 3 * 4
    assert len(r.slot_of) == 4 and sorted(r.slot_of.values()) == [0, 1, 2, 3]


def write_trace(path, L=3, E=16, tokens=60, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        f.write(json.dumps({"format": "mlxmoe.trace/1", "num_layers": L, "num_experts": E, "top_k": 2,
                            "model": "test"}) + "\n")
        for t in range(tokens):
            for l in range(L):
                e = rng.choice(E, 2, replace=False, p=np.arange(1, E + 1) / (E * (E + 1) / 2)).tolist()
                f.write(json.dumps({"s": 0, "t": t, "l": l, "e": e, "p": [0.6, 0.3]}) + "\n")
    return path


def test_replay_output_and_belady_ceiling(tmp_path):
    header, records = read_trace(write_trace(tmp_path / "t.jsonl"))
    results = replay_all(header, records, ["lru", "lfu", "slru", "s3fifo", "activation", "belady"], 12)
    best = results[-1]["hit_rate"]
    for r in results:
        assert set(r) == {"policy", "cache_experts", "accesses", "hits", "hit_rate", "decode_hit_rate",
                          "belady_hit_rate"}
        assert r["accesses"] == 60 * 3 * 2 and r["belady_hit_rate"] == best
        assert 0 <= r["decode_hit_rate"] <= 1
        assert r["hit_rate"] <= best
    # the stack-distance curve is exactly the LRU replay
    keys = [[(l, x) for x in e] for _, l, e, *_ in steps(records, header["num_layers"])]
    for size, rate in lru_curve(keys, [2, 5, 12, 30, 48]):
        assert rate == pytest.approx(replay(header, records, "lru", size)["hit_rate"])


@pytest.mark.parametrize("line,message", [
    ('{"s":0,"t":0,"l":9,"e":[1]}', "out of range"),
    ('{"s":0,"t":0,"e":[1]}', "malformed trace line"),
    ('not json', "malformed trace line"),
    ('{"s":0,"t":0,"l":0,"e":[1],"p":0.5}', "malformed trace line"),
    ('{"s":0,"t":0,"l":0,"e":[1],"p":["a"]}', "malformed trace line"),
    ('{"s":0,"t":0,"l":0,"e":[1],"p":[0.5,0.5]}', "probabilities"),
    ('{"s":0,"t":0,"l":0,"e":[1,2],"p":[0.5]}', "in a top-1 trace"),  # more experts than top-k (issue 43)
])
def test_bad_trace_lines(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"format":"mlxmoe.trace/1","num_layers":2,"num_experts":4,"top_k":1}\n' + line + "\n")
    with pytest.raises(MlxmoeError, match=message) as e:
        read_trace(path)
    assert "bad.jsonl:2" in str(e.value)


def test_replay_fetches_a_prefill_as_one_layer_call(tmp_path):
    """Lines of one multi-token call (consecutive, same sequence and layer) are one fetch,
    split where its experts outgrow the cache, as the runtime splits it; each token's
    router distribution (`r`) reaches the policy as the call's mean."""
    path = tmp_path / "prefill.jsonl"
    lines = [{"format": "mlxmoe.trace/1", "num_layers": 2, "num_experts": 4, "top_k": 1}]
    dist = [[0.7, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1], [0.1, 0.1, 0.7, 0.1]]
    for l in (0, 1):  # prefill of 3 tokens, layer by layer
        lines += [{"s": 0, "t": t, "l": l, "e": [t], "r": dist[t]} for t in range(3)]
    lines += [{"s": 0, "t": 3, "l": l, "e": [3], "r": [0.1, 0.1, 0.1, 0.7]} for l in (0, 1)]  # one decode step
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    header, records = read_trace(path)
    calls = list(steps(records, 2))
    assert [(tokens, layer, experts) for tokens, layer, experts, *_ in calls] == [
        (3, 0, [0, 1, 2]), (0, 1, [0, 1, 2]), (1, 0, [3]), (0, 1, [3])]
    assert np.allclose(calls[0][4], np.mean(dist, axis=0)) and calls[0][3] == pytest.approx([0.3, 0.3, 0.3])
    # two slots: the prefill is fetched in runs of tokens whose experts fit
    assert [experts for _, _, experts, *_ in steps(records, 2, capacity=2)][:2] == [[0, 1], [2]]
    assert replay(header, records, "lru", 8)["accesses"] == 3 + 3 + 1 + 1


def test_trace_router_distribution_must_cover_every_expert(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"format":"mlxmoe.trace/1","num_layers":1,"num_experts":4}\n'
                    '{"s":0,"t":0,"l":0,"e":[1],"r":[0.5,0.5]}\n')
    with pytest.raises(MlxmoeError, match="router distribution of 2 experts"):
        read_trace(path)


@pytest.mark.parametrize("router", [True, False])
def test_activation_counts_a_prefill_call_as_one_visit_by_default(router):
    """By default a prefill is one visit: its short-term estimates decay once and move
    towards the share of its tokens that used each expert (the router's mean distribution
    times top-k; without the router, each expert of the union counts as used); the
    long-run counts take it as one visit of the union. It does not raise the top-k it learns."""
    p = make_policy("activation", 4, 1, 4)
    p.tick(1)
    p.visit(0, [0], None, np.array([0.7, 0.1, 0.1, 0.1]))
    p.tick(7)
    p.visit(0, [0, 1, 2, 3], None, np.array([0.7, 0.1, 0.1, 0.1]) if router else None)
    p = p.estimate
    s = p.slow
    assert p.top_k == 1
    assert p.freq[0, 0] == pytest.approx((1 - s) * s + (1 - s) * (0.7 if router else 1))
    assert p.freq[0, 1] == pytest.approx((1 - s) * (0.1 if router else 1))
    assert p.layer_visits[0] == pytest.approx(1 + 2.0 ** (-1 / 16))  # two visits; the long half-life is at its minimum
    assert p.used_visits[0, 0] == pytest.approx(p.layer_visits[0]) and p.used_visits[0, 1] == pytest.approx(1.0)


def test_default_weighs_a_prefills_experts_by_their_share_of_its_tokens():
    """1 layer of 8 experts, 6 slots, top-2. Tokens use 5 and 6 four times, then 6 and 7;
    a prefill of 8 tokens uses 0, 1 and 2, the router giving 2 one token in ten (0.05 of
    its mass); the next token uses 3 and 6: a victim among 5, 7, 0, 1, 2. 7 and 2 were
    each used at one visit; counted by its share, 2 is the less likely at the next visit
    and goes; counted as used alike (the union of the prefill), 2 would look the more
    recent and 7 would go."""
    p = make_policy(DEFAULT_POLICY, 6, 1, 8)
    r = Residency(6, p)
    evicted = []
    r.evicted = evicted.append
    for _ in range(4):
        r.tick(1)
        r.access(0, [5, 6], probs=np.array([0, 0, 0, 0, 0, 0.5, 0.5, 0]))
    r.tick(1)
    r.access(0, [6, 7], probs=np.array([0, 0, 0, 0, 0, 0, 0.5, 0.5]))
    r.tick(8)
    r.access(0, [0, 1, 2], probs=np.array([0.45, 0.45, 0.05, 0, 0, 0, 0.05, 0]))
    r.tick(1)
    r.access(0, [3, 6], probs=np.array([0, 0, 0, 0.5, 0, 0, 0.5, 0]))
    assert evicted == [(0, 2)]


def test_a_prefill_pass_takes_slots_from_the_layers_it_has_left():
    """3 layers x 8 experts, 9 slots, top-2: six tokens use 0 and 1 at every layer (layer 2
    6 and 7 at the first), then a prefill of 4 tokens uses 0, 1, 4 and 5 at every layer.
    Layer 0's call takes layer 2's stale 6 (no layer is behind it in the pass). Layer 1's
    needs two slots: they come from layer 0, which the pass has left, not from layer 2,
    whose call of 4 tokens comes first (by one token's chance of use its stale 7 is the
    farthest of all); layer 2 then gives up 7 itself."""
    steps = [(int(layer == 0), layer, [6, 7] if layer == 2 and t == 0 else [0, 1]) for t in range(6)
             for layer in range(3)]
    prefill = [(4, 0, [0, 1, 4, 5]), (0, 1, [0, 1, 4, 5]), (0, 2, [0, 1, 4, 5])]
    evicted = run_steps(steps + prefill, capacity=9, layers=3)[0]
    assert evicted == [(2, 6), (0, 4), (0, 5), (2, 7), (1, 4)]


def test_activation_evicts_by_expected_time_with_a_sorted_insert():
    """Two layers, 3 slots. Layer 0 uses expert 1 and layer 1 expert 5 for 4 tokens; at
    token 5 layer 0 uses 2 (the third slot), layer 1 uses 6: a victim among (0, 1), (0, 2),
    (1, 5). Long-run rates (long_rate): 1 and 5 were used at 4 of 5 visits, 2 at 1 of 5
    (plus 4 prior visits at top_k / E = 1/16): 4.25/9 against 1.25/9, and 2's chance of use
    at the next visit (next_chance) is small (one use), so its expected time
    d + L (1 - next_chance) / long_rate is farthest, though it was inserted last (an order
    sorted only at the layer's visit would keep it as the most valuable and evict 5)."""
    seq = [(0, [1]), (1, [5])] * 4 + [(0, [2]), (1, [6])]
    evicted, r = run("activation", 3, seq, layers=2)
    assert evicted == [(0, 2)]
    p = r.policy.estimate
    assert p.long_rate[0, 2] < p.long_rate[0, 1] and p.long_rate[0, 2] < p.long_rate[1, 5]

@pytest.mark.parametrize("options", [{}, {"now_weight": 1.0, "now_scale": 1e9}])
def test_a_key_inserted_into_a_sorted_layer_lands_where_a_full_sort_puts_it(options):
    """The victim index puts a key inserted into a layer it has sorted where sorting the
    layer again would (after the keys of equal cost: ties keep their order), so no victim
    differs from one chosen after a full sort: checked after every insert of a run where
    calls miss several keys at once; with the router's favour alone and saturated, every
    key the router gives a chance ties (cost 0)."""
    rng = np.random.default_rng(1)
    L, E, cap = 3, 16, 12
    r = Residency(cap, make_policy("activation-floor", cap, L, E, **options))
    index, checked = r.policy.index, 0
    insert = index.insert

    def checked_insert(key):
        nonlocal checked
        was_sorted = key[0] not in index.unsorted and index.order[key[0]]
        before = list(index.order[key[0]])
        insert(key)
        if was_sorted:
            order = index.order[key[0]]
            cost = index.estimate.cost[key[0]].tolist()
            assert order == sorted(before + [key[1]], key=cost.__getitem__, reverse=True)
            assert index.head[key[0]] == index.estimate.tail((key[0], order[0]))
            checked += 1

    index.insert = checked_insert
    for t in range(200):
        for layer in range(L):
            if layer == 0:
                r.tick(1)
            experts = sorted(set(rng.choice(E, size=4, p=np.linspace(3, 1, E) / np.linspace(3, 1, E).sum()).tolist()))
            r.access(layer, experts, None, rng.dirichlet(np.ones(E)) if t % 2 or options else None)
    assert checked > 100


def test_slru_pins_the_profiles_hottest_by_default():
    import numpy as np

    from mlxmoe.caching.policies import make_policy

    prior = np.zeros((2, 8))
    prior[1, 3], prior[0, 5], prior[0, 1] = 0.9, 0.5, 0.1
    p = make_policy("slru", 16, 2, 8, prior=prior)  # protected segment 12, pins at most 3
    assert p.pinned == {(1, 3), (0, 5), (0, 1)}
    assert make_policy("slru", 8, 2, 8, prior=prior).pinned == {(1, 3)}  # protected 6: 1 pin
    assert make_policy("slru", 16, 2, 8).pinned == set()
    assert make_policy("slru", 16, 2, 8, prior=prior, pinned=()).pinned == set()


def test_s3fifo_evicts_from_small_when_main_is_all_protected():
    """A call that needs every slot (a prefill chunk) protects all of main; the victim is
    then the small queue's unprotected key (S3-FIFO raised 'no victim' there)."""
    A = list(range(40))
    calls = [(0, [4]), (0, [1, 2, 3, 4, 5, 7, 12, 13, 15, 17, 18, 19, 20, 21, 22, 25, 26, 27, 32, 33, 34, 36, 37, 39]),
             (0, [8, 18, 26]), (0, [36]), (1, [6, 37]), (0, [35]), (0, [39]),
             (0, [0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 18, 19, 20, 23, 25, 26, 27, 28, 29, 30, 31, 33, 34,
                  35, 37, 38, 39]), (1, A),
             (0, [0, 4, 5, 7, 8, 9, 10, 11, 13, 14, 15, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 30, 31, 32, 33, 34,
                  39]),
             (0, [0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 14, 17, 18, 19, 20, 21, 22, 23, 25, 26, 29, 30, 32, 35, 36,
                  37, 38, 39]), (0, A), (0, [12, 33]), (1, [1])]
    r = Residency(40, make_policy("s3fifo", 40, 2, 40))
    for layer, experts in calls:
        r.access(layer, experts)
    assert len(r.policy.small) < r.policy.small_capacity  # so the victim is looked for in main first
    r.access(1, A)  # all 40 slots for layer 1
    assert set(r.slot_of) == {(1, e) for e in A}


@pytest.mark.parametrize("layers", [1, 2])
def test_replay_matches_the_runtime(checkpoint, tmp_path, layers):
    """The same hits in a replay of a run's trace as in the run (prefetch off), for every
    policy; with one MoE layer too, where only the trace's call sizes tell a prefill from
    decode steps."""
    import mlxmoe
    from mlxmoe.caching.policies import ONLINE

    path = checkpoint("qwen3_moe", quant="4bit", config_overrides={"num_hidden_layers": layers})
    for policy in ONLINE:
        trace = tmp_path / f"{policy}.trace.jsonl"
        model, tokenizer = mlxmoe.load(str(path), cache_experts=4, policy=policy, prefetch=0, prewarm=False,
                                       trace_out=str(trace))
        for prompt in ("The quick brown fox jumps over the lazy dog", "Hello"):
            mlxmoe.generate(model, tokenizer, prompt, max_tokens=10)
        stats = model.expert_cache.stats()
        model.expert_cache.close()
        header, records = read_trace(trace)
        r = replay(header, records, policy, 4)
        assert (r["hits"], r["accesses"]) == (stats["hits"], stats["hits"] + stats["misses"]), policy


@pytest.mark.parametrize("name", ["lru", "lfu", "slru", "s3fifo", "activation", "activation-floor"])
def test_deferring_all_hit_calls_changes_no_decision(name):
    """The runtime's Residency defers the policy updates of layer calls that hit; the
    policy must see the same calls in the same order, so every eviction, claim and hit is
    the one the replay (which does not defer) makes."""
    rng = np.random.default_rng(0)
    L, E, k = 3, 8, 2
    runs = [Residency(9, make_policy(name, 9, L, E), defer_hits=defer) for defer in (False, True)]
    log, deferred = [[], []], 0
    for r, out in zip(runs, log):
        r.evicted = out.append
    for t in range(300):
        n = 3 if t % 40 == 0 else 1  # now and then a prefill-like call of 3 tokens
        for layer in range(L):
            hot = rng.choice(E, size=k * n, replace=True, p=np.linspace(2, 1, E) / np.linspace(2, 1, E).sum())
            experts = sorted(set(hot.tolist()))
            probs = rng.dirichlet(np.ones(E))
            claim = [(int((layer + 1) % L), int(e)) for e in rng.choice(E, size=2, replace=False)]
            for r, out in zip(runs, log):
                if layer == 0:
                    r.tick(n)
                before = len(r.deferred)
                slots, missed = r.access(layer, experts, probs[experts].tolist(), probs)
                deferred += len(r.deferred) > before
                out.append(("access", tuple(slots), tuple(missed)))
                if t % 3 == 0:  # a prefetch claims two keys of the next layer
                    out.append(("claim", tuple(r.claim(claim, {(layer, e) for e in experts}, evict=True))))
                if t % 50 == 7 and r.slot_of:  # a key leaves (an interrupted read)
                    key = sorted(r.slot_of)[0]
                    r.free.append(r._release(key))
    assert log[0] == log[1]
    assert (runs[0].counters.hits, runs[0].counters.misses) == (runs[1].counters.hits, runs[1].counters.misses)
    assert deferred > 50  # of 900 layer calls, many hit and waited for the policy


def test_unknown_option_is_refused_naming_it_and_the_policy():
    """A mistyped tuning knob is an error, not silently ignored; every real option, and a
    profile's prior, is still taken (the default's own and those it inherits)."""
    with pytest.raises(MlxmoeError, match=r"policy 'activation-floor' has no option 'halflife'.*half_life"):
        make_policy("activation-floor", 8, 2, 8, halflife=1)
    with pytest.raises(MlxmoeError, match=r"policy 'lru' has no option 'half_life' \(its options: prior\)"):
        make_policy("lru", 8, 2, 8, half_life=4)
    prior = np.full((2, 8), 0.25)
    p = make_policy("activation-floor", 8, 2, 8, half_life=1, floor_slack=None, prior=prior, now_weight=0.3)
    assert p.floor is None and p.estimate.slow == 0.5 and p.estimate.now_weight == 0.3
    assert np.array_equal(p.estimate.prior, prior)
    assert p.name == "activation-floor"
    assert make_policy("activation", 8, 2, 8, floor_slack=0).floor.floor == 4
    assert make_policy(DEFAULT_POLICY, 8, 2, 8).floor.floor == 4  # less floor_slack x top_k once top_k is seen
    assert make_policy("lfu", 8, 2, 8, half_life=4, prior=prior).counts.growth == 2 ** 0.25
    assert make_policy("slru", 8, 2, 8, window=2, pin_share=0.5, prior=prior).window == 2
    make_policy("s3fifo", 8, 2, 8, small_share=0.2, prior=prior)
    for name in ("layer-lru", "layer-lfu", "lfuda"):
        make_policy(name, 8, 2, 8, prior=prior)


def test_optional_hooks_are_declared():
    """The hooks the cache and the prefetcher use exist on every policy: None where the
    policy keeps no estimate of next use, so neither looks them up by name."""
    from mlxmoe.caching.prefetch import visit_steps

    for name in ("lru", "lfu", "slru", "s3fifo", "layer-lru", "layer-lfu", "lfuda"):
        p = make_policy(name, 8, 2, 8)
        assert p.estimate is None
    p = make_policy(DEFAULT_POLICY, 8, 2, 8).estimate
    p.current = 0
    p.miss_cost[1] = 0.5
    # a guess of layer 1 used at half its visits: 1 + 2 (1/0.5 - 1) layer steps, at half the cost
    assert visit_steps(p, (1, 3), 0.5) == pytest.approx((1 + 2 * 1.0) / 0.5)
    assert visit_steps(p, (0, 3), 1.0) == 2.0  # the current layer's: its next visit, a round of layers away


def test_one_ranking_of_the_hottest():
    """Pins, the prefetcher's profile guesses and a profile's top list rank experts the
    same way: highest rate first, the lower index on ties; pins skip unused experts."""
    from mlxmoe.caching.policies import hottest, pins
    from mlxmoe.caching.prefetch import hottest_per_layer
    from mlxmoe.workload.profile import ActivationProfile

    rates = np.array([[0.1, 0.5, 0.0, 0.5], [0.0, 0.0, 0.2, 0.0]])
    assert hottest(rates, 3) == [(0, 1), (0, 3), (1, 2)]
    assert hottest(rates, 2, layer=1) == [(1, 2), (1, 0)]
    assert pins(rates, 8) == [(0, 1), (0, 3), (1, 2), (0, 0)]
    assert pins(None, 3) == [] and pins(rates, 0) == []
    assert hottest_per_layer(rates, 2) == [{1, 3}, {2, 0}]
    profile = ActivationProfile(2, 4, 2, counts=rates * 10, tokens=10)
    assert [(l, e) for l, e, _ in profile.top(3)] == hottest(rates, 3)
    assert profile.priority() == pins(rates, 8)


def test_keys_with_homes_take_them_in_any_order():
    """Where every key has a home slot (a cache with room for all), a key read, claimed or
    read again after it was forgotten takes its home, whatever the order; a resize moves the
    keys to slots 0, 1... and ends the homes."""
    L, E = 3, 4
    r = Residency(L * E + 2, make_policy("lru", L * E + 2, L, E))
    r.home = lambda key: key[0] * E + key[1]
    rng = np.random.default_rng(0)
    keys = [(m, e) for m in range(L) for e in range(E)]
    order = rng.permutation(len(keys))
    for i in order[:5]:
        r.access(*keys[i][:1], [keys[i][1]])
    r.claim([keys[i] for i in order[5:]])
    assert r.slot_of == {key: key[0] * E + key[1] for key in keys}
    r.forget([(1, 2), (0, 0)])
    r.claim([(0, 0)])
    _, missed = r.access(1, [2, 3])
    assert r.slot_of[(0, 0)] == 0 and missed == [(2, 1 * E + 2)] and len(r.free) == 2
    r.forget([(2, 1)])
    r.resize(L * E)
    assert r.home is None and sorted(r.slot_of.values()) == list(range(L * E - 1))
