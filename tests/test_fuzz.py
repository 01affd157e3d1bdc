"""Seeded random mutation of every input mlxmoe parses: profiles, traces, safetensors
headers, config.json and the tokenizer's files, every numeric CLI option, the importers'
sources and the server's request bodies (there: every case an HTTP answer, 200 or a JSON
400/413, never a dropped connection or a traceback in the log). Each case
ends in success (and what was read works: replays, saves and loads back) or in one
MlxmoeError (CLI: one `error:` line, exit 2) that names the file or option: never
another exception, a hang or a file that cannot be loaded back. CASES per parser; the
figures are printed with -s (bench/RESULTS.md, "Fuzz and kill tests")."""

import contextlib
import copy
import json
import math
import os
import random
import signal

import numpy as np
import pytest
from conftest import run_cli

from mlxmoe.backend import detect
from mlxmoe.storage.convert import header as safetensors_header
from mlxmoe.errors import MlxmoeError
from mlxmoe.loader import DEMO_MODEL, open_checkpoint, read_config, read_tokenizer
from mlxmoe.workload.profile import ActivationProfile
from mlxmoe.storage.shards import BUNDLE_FORMAT, read_header
from mlxmoe.workload.trace import predictor_scores, read_trace, replay

CASES = int(os.environ.get("MLXMOE_FUZZ_CASES", 500))
CASE_SECONDS = 20  # a case that takes longer is a hang

# Values a field is replaced with: wrong types, edges of ranges, non-finite, huge, deep.
ODD = [None, True, False, 0, 1, -1, 2, 3, 0.5, -0.0, 1e-300, 1e308, -1e308, float("nan"), float("inf"),
       float("-inf"), 2 ** 31, 2 ** 63, 10 ** 30, 10 ** 400, "", "x", "2", "NaN", "1e9", [], {}, [[]], [1, 2],
       [[1, 2], [3]], {"a": 1}, "\u00e9\x00", [[[[[[[[[[1]]]]]]]]]]]


def odd_value(rng, old):
    """A replacement for `old`: an odd value, or one near it."""
    if isinstance(old, bool) or rng.random() < 0.6:
        return copy.deepcopy(rng.choice(ODD))
    if isinstance(old, int):
        return rng.choice([old - 1, old + 1, old * 2, -old, old * 10 ** 9, 0])
    if isinstance(old, float):
        return rng.choice([old * -1, old * 1e300, old + 1, 0.0, float("nan")])
    if isinstance(old, str):
        return rng.choice([old + "x", old[:1], old * 3, old.upper()])
    if isinstance(old, list):
        return rng.choice([old[:-1], old + old[-1:], old[::-1], [old], old * 2] if old else [[0], [[]]])
    return copy.deepcopy(rng.choice(ODD))


def paths(obj, prefix=(), limit=2000):
    """Every place in a JSON value (keys and indexes), up to `limit` of them."""
    out = [prefix]
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        if len(out) >= limit:
            break
        out += paths(v, prefix + (k,), limit - len(out))
    return out


def mutate_json(value, rng, rounds=None):
    """A copy of `value` with 1-3 places replaced, deleted or added."""
    value = json.loads(json.dumps(value))
    for _ in range(rounds or rng.randint(1, 3)):
        where = rng.choice(paths(value))
        if not where:
            value = odd_value(rng, value)
            continue
        parent = value
        for k in where[:-1]:
            parent = parent[k]
        k, r = where[-1], rng.random()
        if r < 0.15 and isinstance(parent, dict):
            del parent[k]
        elif r < 0.25 and isinstance(parent, dict):
            parent[rng.choice(["junk", "n", "e", "format"])] = copy.deepcopy(rng.choice(ODD))
        else:
            parent[k] = odd_value(rng, parent[k])
    return value


def mutate_bytes(data, rng):
    """`data` with bytes flipped, a piece cut, repeated or inserted, or truncated."""
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(data) + 1)
        r = rng.random()
        if r < 0.3 and data:
            data[min(i, len(data) - 1)] = rng.randrange(256)
        elif r < 0.5:
            del data[i:i + rng.randint(1, 64)]
        elif r < 0.7:
            data[i:i] = data[max(0, i - 32):i]
        elif r < 0.85:
            data[i:i] = rng.choice([b"{", b"[", b"]", b"\"", b",", b"NaN", b"\xff\xfe", b"\n", b"1e999"])
        else:
            del data[i:]
    return bytes(data)


def dumps(value):
    return json.dumps(value, separators=(",", ":")).encode()


def mutated(base, rng):
    """A mutated file body for the JSON value `base`: structure (70 %) or bytes."""
    if rng.random() < 0.7:
        return dumps(mutate_json(base, rng))
    return mutate_bytes(dumps(base), rng)


@contextlib.contextmanager
def deadline(seconds, what):
    def expired(signum, frame):
        raise AssertionError(f"{what}: still running after {seconds} s (a hang)")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class Tally:
    """Outcomes of the cases of one parser; printed for bench/RESULTS.md."""

    def __init__(self, name):
        self.name, self.ok, self.refused = name, 0, 0

    def case(self, path, fn, *names):
        """Run fn(); success, or an MlxmoeError naming `path` (or one of `names`)."""
        with deadline(CASE_SECONDS, f"{self.name} case {self.ok + self.refused}"):
            try:
                fn()
            except MlxmoeError as e:
                assert any(str(n) in str(e) for n in (path, *names)), f"{self.name}: {e} does not name {path}"
                self.refused += 1
                return False
        self.ok += 1
        return True

    def report(self):
        total = self.ok + self.refused
        print(f"\nfuzz {self.name}: {total} cases, {self.ok} read, {self.refused} refused with a named error, "
              "0 other outcomes")
        assert total >= CASES


# Profiles
def test_fuzz_profiles(tmp_path):
    rng = random.Random(15)
    p = ActivationProfile(3, 6, 2, model="m", model_fingerprint="fp", workload="w", expert_bytes=1000,
                          resident_bytes=5000)
    for _ in range(20):
        p.tick(1)
        for l in range(3):
            p.observe(l, rng.sample(range(6), 2), scores=[0.6, 0.3])
    p.curve = {"lru": [[2, 0.1], [9, 0.5], [18, 1.0]]}
    base = p.to_json()
    tally = Tally("profile")
    path, saved = tmp_path / "p.json", tmp_path / "saved.json"
    for _ in range(CASES):
        path.write_bytes(mutated(base, rng))

        def use():
            q = ActivationProfile.load(path)
            q.rates(), q.top(3), q.priority(), q.hot_share(), q.diff(q)
            try:  # what is saved loads back, the same
                q.save(saved)
            except MlxmoeError as e:
                assert str(saved) in str(e)
                assert not saved.exists()
                return
            r = ActivationProfile.load(saved)
            np.testing.assert_allclose(r.counts, q.counts, atol=1e-3, rtol=1e-6)
            saved.unlink()
            code, out, err = run_cli("profile", "show", path, "--json", "--budget", "1MB")
            assert code == 0, err
            json.loads(out, parse_constant=refuse_constant)  # strict JSON: no NaN or Infinity

        tally.case(path, use)
    tally.report()


def refuse_constant(name):
    raise AssertionError(f"not JSON: {name}")


# Traces
def trace_lines(rng, L=3, E=8, k=2):
    header = {"format": "mlxmoe.trace/1", "num_layers": L, "num_experts": E, "top_k": k, "model": "m"}
    lines = []
    for s in range(2):
        for l in range(L):  # a prefill of 3 tokens: one layer call per layer
            for t in range(3):
                e = rng.sample(range(E), k)
                lines.append({"s": s, "t": t, "l": l, "e": e, "n": 3, "p": [0.6, 0.3]})
        for t in range(3, 7):
            for l in range(L):
                r = [round(rng.random() / E, 3) for _ in range(E)]
                lines.append({"s": s, "t": t, "l": l, "e": rng.sample(range(E), k), "p": [0.5, 0.2], "r": r})
    return header, lines


def test_fuzz_traces(tmp_path):
    rng = random.Random(7)
    header, lines = trace_lines(rng)
    tally = Tally("trace")
    path = tmp_path / "t.jsonl"
    for _ in range(CASES):
        if rng.random() < 0.8:  # mutate the header or a few lines
            hd, ls = header, list(lines)
            if rng.random() < 0.3:
                hd = mutate_json(header, rng)
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(len(ls))
                ls[i] = mutate_json(ls[i], rng, 1)
            if rng.random() < 0.2:
                del ls[rng.randrange(len(ls)):]
            body = b"\n".join(dumps(x) for x in [hd] + ls) + b"\n"
        else:
            body = mutate_bytes(b"\n".join(dumps(x) for x in [header] + lines) + b"\n", rng)
        path.write_bytes(body)

        def use():
            hd, records = read_trace(path)
            k = max(len(set(r[3])) for r in records)
            for policy in ("lru", "belady"):
                result = replay(hd, records, policy, k + rng.randrange(3))
                assert 0 <= result["hit_rate"] <= 1
            predictor_scores(records)

        tally.case(path, use)
    tally.report()


# Safetensors headers
def safetensors_file(rng, bundled=False):
    if bundled:
        parts = [["m.switch_mlp.up_proj.weight", "F32", [2, 3], 0], ["m.switch_mlp.down_proj.weight", "F16", [3, 2],
                                                                     24]]
        meta = {"format": BUNDLE_FORMAT, "bundles": json.dumps({"m.bundle": parts})}
        head = safetensors_header([("m.bundle", "U8", (2, 4096))], meta, 4096)
        data = bytes(2 * 4096)
    else:
        entries = [("a", "F32", (2, 3)), ("b", "BF16", (4,)), ("c", "U8", (5,))]
        head = safetensors_header(entries, {"format": "mlx"})
        data = bytes(rng.randrange(256) for _ in range(24 + 8 + 5))
    return head, data


def test_fuzz_safetensors_headers(tmp_path):
    rng = random.Random(3)
    tally = Tally("safetensors header")
    path = tmp_path / "model.safetensors"
    for i in range(CASES):
        head, data = safetensors_file(rng, bundled=i % 3 == 0)
        n = int.from_bytes(head[:8], "little")
        if rng.random() < 0.6:  # the JSON header, its length field rewritten to match
            text = mutated(json.loads(head[8:8 + n]), rng)
            body = len(text).to_bytes(8, "little") + text + data
        else:
            body = mutate_bytes(head + data, rng)
        path.write_bytes(body)

        def use():  # every tensor (every expert's row of a bundle) lies inside the file
            size = path.stat().st_size
            for info in read_header(path).values():
                rows = info.shape[0] if info.shape else 1
                row = info.nbytes // rows if rows else 0
                assert 0 <= info.offset and info.offset + max(rows - 1, 0) * (info.stride or row) + row <= size

        tally.case(path, use)
    tally.report()


# config.json and the tokenizer
def test_fuzz_config_and_tokenizer(tmp_path):
    rng = random.Random(11)
    folder = tmp_path / "c"
    folder.mkdir()
    os.symlink(DEMO_MODEL / "model.safetensors", folder / "model.safetensors")
    originals = {name: json.loads((DEMO_MODEL / name).read_text())
                 for name in ("config.json", "tokenizer.json", "tokenizer_config.json")}
    backend = detect("cpu")
    tally = Tally("config/tokenizer")
    for _ in range(CASES):
        target = rng.choice(["config.json"] * 3 + ["tokenizer.json", "tokenizer_config.json"])
        for name, value in originals.items():
            (folder / name).write_bytes(mutated(value, rng) if name == target else dumps(value))
        if rng.random() < 0.05:  # a file missing, or a folder in its place
            victim = folder / rng.choice(list(originals))
            victim.unlink()
            if rng.random() < 0.5:
                victim.mkdir()

        def use():
            from mlxmoe.api import checkpoint_plan

            read_config(folder)
            ckpt = open_checkpoint(folder)
            try:
                checkpoint_plan(ckpt, backend, "1GB")
                read_tokenizer(folder, eos_token_ids=ckpt.config.get("eos_token_id"))
            finally:
                ckpt.store.close()

        tally.case(folder, use)
        for name in originals:
            p = folder / name
            if p.is_dir():
                p.rmdir()
    tally.report()


# Numeric CLI options
def number_text(rng):
    """A command-line value: numbers of every shape, sizes with units good and bad, junk."""
    r = rng.random()
    if r < 0.25:
        return str(rng.randint(-5, 100))
    if r < 0.4:
        return repr(rng.uniform(-2, 2))
    if r < 0.55:
        return rng.choice(["nan", "inf", "-inf", "1e308", "1e309", "-0", "0", "0.0", "1e-400", "99999999999999999999999",
                           str(2 ** 64), str(2 ** 64 - 1), "", " ", "1,5", "0x10", "1_000", "+3", "١٢", "--", "-1"])
    if r < 0.85:
        number = rng.choice(["1", "42", "1.5", ".5", "0", "99999999999999999999999", "1e3", "-1", "nan"])
        unit = rng.choice(["", "B", "K", "KB", "KiB", "M", "MB", "MiB", "G", "GB", "GiB", "T", "TB", "TiB", "gb", "mb",
                           "Mb", "Gb", "mB", "GIB", "PB", "bytes", "%", " GB", "G B"])
        return number + unit
    return "".join(rng.choice("0123456789.eE+-xGMBKnai ,") for _ in range(rng.randint(1, 8)))


def valid_size(text):
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(B|K|KB|KiB|M|MB|MiB|G|GB|GiB|T|TB|TiB|b|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|"
                     r"tib)?\s*", text)
    if not m:
        return False
    scale = {"": 0, "b": 0, "k": 10, "m": 20, "g": 30, "t": 40}[(m.group(2) or "")[:1].lower()]
    return float(m.group(1)) * 2 ** scale <= 2 ** 60


def number(text, kind):
    try:
        x = kind(text)
    except (ValueError, OverflowError):
        return None
    return x if kind is int or math.isfinite(x) else None


def in_range(kind, low=None, high=None, low_open=False):
    def ok(text):
        x = number(text, kind)
        return x is not None and (low is None or (x > low if low_open else x >= low)) and (high is None or x <= high)
    return ok


MISSING = "/nonexistent/model"
# option -> (command line with {} for the value, what a valid value is, independently of mlxmoe)
OPTIONS = {
    "--max-tokens": (["generate", "-m", MISSING, "-p", "hi", "--max-tokens", "{}"], in_range(int, 1, 2 ** 31)),
    "--temp": (["generate", "-m", MISSING, "-p", "hi", "--temp", "{}"], in_range(float, 0)),
    "--top-p": (["generate", "-m", MISSING, "-p", "hi", "--top-p", "{}"], in_range(float, 0, 1, low_open=True)),
    "--seed": (["generate", "-m", MISSING, "-p", "hi", "--seed", "{}"], in_range(int, 0, 2 ** 64 - 1)),
    "--memory-budget": (["generate", "-m", MISSING, "-p", "hi", "--memory-budget", "{}"], valid_size),
    "--cache-size": (["chat", "-m", MISSING, "--cache-size", "{}"], valid_size),
    "--repetition-penalty": (["chat", "-m", MISSING, "--repetition-penalty", "{}"], in_range(float, 1)),
    "--cache-experts": (["generate", "-m", MISSING, "-p", "hi", "--cache-experts", "{}"], in_range(int, 1)),
    "--prefetch": (["generate", "-m", MISSING, "-p", "hi", "--prefetch", "{}"], in_range(int, 0, 64)),
    "--max-context": (["generate", "-m", MISSING, "-p", "hi", "--max-context", "{}"], in_range(int, 16, 2 ** 24)),
    "--trim": (["generate", "-m", MISSING, "-p", "hi", "--trim", "{}"], in_range(float, 0, 1)),
    "--cache-bias": (["generate", "-m", MISSING, "-p", "hi", "--cache-bias", "{}"], in_range(float, 0)),
    "--trim-mass": (["generate", "-m", MISSING, "-p", "hi", "--trim-mass", "{}"], in_range(float, 0, 1)),
    "--max-queue": (["serve", "-m", MISSING, "--max-queue", "{}"], in_range(int, 1, 4096)),
    "--idle-timeout": (["serve", "-m", MISSING, "--idle-timeout", "{}"], in_range(float, 0, 86400, low_open=True)),
    "--half-life": (["profile", "record", "-m", MISSING, "--prompts", __file__, "-w", "w", "-o", "{out}",
                     "--half-life", "{}"], in_range(float, 1)),  # (a profile's half-life: at least 1 token)
    "--top": (["profile", "show", "{missing}", "--top", "{}"], in_range(int, 0, 2 ** 31)),
    "--budget": (["profile", "show", "{missing}", "--budget", "{}"], valid_size),
    "info --memory-budget": (["info", "-m", MISSING, "--memory-budget", "{}"], valid_size),
    "replay --cache-experts": (["trace", "replay", "{missing}", "--cache-experts", "{}"], in_range(int, 1, 2 ** 22)),
    "--num-layers": (["trace", "import", "vllm", "{missing}", "-o", "{out}", "--num-layers", "{}"],
                     in_range(int, 1, 2 ** 16)),
    "--num-experts": (["trace", "import", "vllm", "{missing}", "-o", "{out}", "--num-experts", "{}"],
                      in_range(int, 1, 2 ** 16)),
    "--top-k": (["trace", "import", "vllm", "{missing}", "-o", "{out}", "--top-k", "{}"], in_range(int, 1, 2 ** 16)),
    "from-trace --half-life": (["profile", "from-trace", "{missing}", "-o", "{out}", "--half-life", "{}"],
                               in_range(float, 1)),
    "--weights": (["profile", "merge", "{missing}", "{missing}", "-o", "{out}", "--weights", "{}"],
                  lambda text: all(number(x, float) is not None and number(x, float) >= 0 for x in text.split(","))
                  and len(text.split(",")) == 2 and any(number(x, float) for x in text.split(","))),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_fuzz_numeric_options(option, tmp_path):
    rng = random.Random(option)
    args, valid = OPTIONS[option]
    flag = option.split()[-1]
    accepted = refused = 0
    for i in range(CASES):
        if option == "--weights":
            text = ",".join(number_text(rng) for _ in range(rng.choice([1, 2, 2, 2, 3])))
        else:
            text = number_text(rng)
        line = [a.format(text, out=tmp_path / "out.json", missing=tmp_path / "missing") if "{" in a else a
                for a in args]
        with deadline(CASE_SECONDS, f"{option} {text!r}"):
            code, _, err = run_cli(*line)
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (option, text, code, err)
        names_option = flag in lines[0]
        assert names_option != valid(text), (option, text, err)  # refused exactly the invalid values, naming it
        accepted += not names_option
        refused += names_option
        assert not (tmp_path / "out.json").exists()
    print(f"\nfuzz {option}: {CASES} cases, {accepted} accepted (then stopped at the missing model or file), "
          f"{refused} refused naming {flag}")


# Importers (issue 29): each mutated source is imported into a trace that read_trace and
# replay take, or refused with an MlxmoeError naming the source
def import_sources(rng):
    """{format: (file name, body)} of small valid sources, one per importer."""
    import base64

    vllm = [{"type": "route", "req_id": "a", "token_idx": t, "layer": l, "topk_ids": [(t + l) % 6, (t + l + 1) % 6],
             "topk_weights": [0.7, 0.3]} for t in range(3) for l in range(2)]
    specmoe = [{"dataset": "d", "problem_id": 0, "layer": l, "token_idx": t, "experts": [t % 8, 7 - l],
                "gating_probs": [0.6, 0.4]} for l in range(2) for t in range(3)]
    ocs = {"meta": {"model_id": "m", "num_moe_layers": 2, "num_experts": 8, "top_k": 2},
           "routes": [{"token_pos": t, "phase": "prefill" if t < 2 else "decode",
                       "layers": {str(l): {"experts": [t % 8, 7 - l], "weights": [0.6, 0.4]} for l in range(2)}}
                      for t in range(4)]}
    ids = np.array([[[(t + l) % 8, 7 - l] for l in range(2)] for t in range(4)], np.int32)
    sglang = {"meta_info": {"id": "r", "prompt_tokens": 3, "completion_tokens": 2,
                            "routed_experts": base64.b64encode(ids.tobytes()).decode()}}
    csv = "# route_trace v1\n# model=/x/t.gguf n_layer=2 n_expert=6 n_expert_used=2\n" \
          "turn,phase,step,layer,slot,expert,weight\n" + "".join(
              f"0,{0 if s < 2 else 1},{s},{l},{k},{(s + l + k) % 6},{0.6 - 0.2 * k}\n"
              for s in range(3) for l in range(2) for k in range(2))
    return {"vllm": ("r.jsonl", vllm), "specmoe": ("r.jsonl", specmoe), "moe-ocs": ("r.json", ocs),
            "sglang": ("r.json", sglang), "bigmoeonedge": ("r.csv", csv)}


def mutated_source(rng, body):
    if isinstance(body, str):
        return mutate_bytes(body.encode(), rng)
    if isinstance(body, list):  # JSONL: one line mutated (or the bytes of the whole)
        lines = [dumps(x) for x in body]
        i = rng.randrange(len(lines))
        lines[i] = mutated(body[i], rng)
        return b"\n".join(lines) + b"\n"
    return mutated(body, rng)


@pytest.mark.parametrize("fmt", ["vllm", "specmoe", "moe-ocs", "sglang", "bigmoeonedge"])
def test_fuzz_imports(fmt, tmp_path):
    from mlxmoe.workload.trace import import_trace

    rng = random.Random(f"import {fmt}")
    name, body = import_sources(rng)[fmt]
    src, out = tmp_path / name, tmp_path / "t.jsonl"
    tally = Tally(f"trace import {fmt}")
    kw = {"num_layers": 2} if fmt == "sglang" else {}
    for i in range(CASES):
        src.write_bytes(mutated_source(rng, body))
        if out.exists():
            out.unlink()

        def run():
            import_trace(fmt, src, out, **kw)
            header, records = read_trace(out)  # what an import writes, its own reader takes
            replay(header, records, "lru", max(2, header["num_layers"] * header["num_experts"] // 2))

        if not tally.case(src, run):
            assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [name]
    tally.report()


# The server (issue 29): every mutated request gets an HTTP answer (200, or 400/413 with a
# JSON error), the connection is never dropped and the server logs no traceback
SERVER_BODIES = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "Il gatto"}], "max_tokens": 4,
                             "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["\n"], "stream": False,
                             "logit_bias": {"5": 1.0}, "mlxmoe": {"profile": None}},
    "/v1/completions": {"prompt": "The cat", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
                        "repetition_penalty": 1.1, "top_k": 5, "n": 1},
    "/v1/messages": {"model": "m", "max_tokens": 4, "system": "Be brief.",
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                     "stop_sequences": ["x"]},
}


def short(body):
    """A mutated body with its token counts kept small (the fuzz is of parsing, not of decoding)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if isinstance(value, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            v = value.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 8:
                value[key] = 8
        return dumps(value)
    return body


def test_fuzz_server_requests():
    from test_server import Server

    rng = random.Random("server")
    server = Server("--memory-budget", "46MB", "--max-tokens", "4")
    statuses = {}
    try:
        for i in range(CASES):
            path = rng.choice(list(SERVER_BODIES))
            body = short(mutated(SERVER_BODIES[path], rng))
            with deadline(CASE_SECONDS * 3, f"server case {i}"):
                status, _, data = server.request("POST", path, raw=body)  # a dropped connection raises
            statuses[status] = statuses.get(status, 0) + 1
            assert status in (200, 400, 413), (status, body[:200], data[:200])
            if status != 200:
                error = json.loads(data)["error"]
                assert error["message"], data
        assert server.json("GET", "/health")[2] == {"status": "ok"}
    finally:
        code = server.stop()
    log = "".join(server.lines)
    assert code == 0 and "Traceback" not in log, log[-3000:]
    print(f"\nfuzz server requests: {CASES} cases, " + ", ".join(f"{n} answered {s}" for s, n in sorted(
        statuses.items())) + ", 0 dropped, 0 tracebacks")


# The server's HTTP/1.1 framing (issue 44): bodies chunked in random pieces (extensions,
# trailers, either hex case) or by a Content-Length, half of them broken (bytes mutated, cut, a
# length off by a few): each an HTTP answer (200, a JSON 400/413, 408 for a body that stops
# coming), never a dropped connection; a well framed one leaves its connection in step (the
# next request on it answered).
FRAMING_CASES = max(20, CASES // 5)


def chunked_wire(body, rng):
    """`body` as chunks in 1-5 random pieces, then the last chunk and the trailers' end."""
    cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randint(0, 4))))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]
    return b"".join(rng.choice([b"%x", b"%X", b"00%x"]) % len(piece) + rng.choice([b"", b";ext=1"]) + b"\r\n"
                    + piece + b"\r\n" for piece in pieces) + b"0\r\n" + rng.choice([b"", b"X-T: 1\r\n"]) + b"\r\n"


def framed_request(path, body, rng):
    """(the request's bytes, whether its framing is intact)."""
    if rng.random() < 0.5:
        wire, framing = chunked_wire(body, rng), "Transfer-Encoding: chunked"
        intact = rng.random() < 0.5
        wire = wire if intact else mutate_bytes(wire, rng)
    else:
        off = rng.choice([0, 0, 0, -1, 1, -7, 7])
        wire, framing, intact = body, f"Content-Length: {max(0, len(body) + off)}", off == 0
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{framing}\r\n\r\n".encode() + wire, intact


def test_fuzz_server_framing():
    import http.client
    import socket

    from test_server import Server

    rng = random.Random("framing")
    server = Server("--memory-budget", "46MB", "--max-tokens", "4", "--idle-timeout", "1")
    statuses, kept = {}, 0
    try:
        for i in range(FRAMING_CASES):
            path = rng.choice(list(SERVER_BODIES))
            body = short(mutated(SERVER_BODIES[path], rng)) if rng.random() < 0.3 else dumps(SERVER_BODIES[path])
            request, intact = framed_request(path, body, rng)
            with deadline(CASE_SECONDS * 3, f"framing case {i}"), socket.create_connection(
                    ("127.0.0.1", server.port), timeout=CASE_SECONDS) as sock:
                sock.sendall(request)
                answer = http.client.HTTPResponse(sock)
                answer.begin()  # (a dropped connection raises)
                data = answer.read()
                statuses[answer.status] = statuses.get(answer.status, 0) + 1
                assert answer.status in (200, 400, 408, 413), (answer.status, request[:300], data[:200])
                if answer.status != 200:
                    assert json.loads(data)["error"]["message"], data
                if intact and not answer.will_close:  # the connection is in step: the next request answered
                    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                    following = http.client.HTTPResponse(sock)
                    following.begin()
                    assert following.status == 200 and json.loads(following.read())["data"], request[:300]
                    kept += 1
        assert kept > 0
    finally:
        code = server.stop()
    log = "".join(server.lines)
    assert code == 0 and "Traceback" not in log, log[-3000:]
    print(f"\nfuzz server framing: {FRAMING_CASES} cases, " + ", ".join(f"{n} answered {s}" for s, n in sorted(
        statuses.items())) + f", {kept} connections kept in step, 0 dropped, 0 tracebacks")
