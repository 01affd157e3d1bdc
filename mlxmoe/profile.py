"""ActivationProfile: which experts a workload uses, saved as `mlxmoe.profile/1` JSON.

Per (layer, expert): activation counts and router probability mass, both decayed with a
half-life in tokens (so a profile follows a workload that changes), the decayed number
of tokens they came from, and the model's fingerprint. Rates (counts / tokens) are what
policies take as their prior. A profile can carry a predicted hit-rate-vs-cache-size
curve computed from the access sequence it was recorded from.
"""

import hashlib
import json
import math
import os
import struct
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from .errors import MlxmoeError, umask

FORMAT = "mlxmoe.profile/1"
DEFAULT_HALF_LIFE = 4096  # tokens: a profile remembers a long session, and still adapts


def fingerprint(config, tensors, shapes, num_layers, num_experts):
    """Hash of the config's architecture and of the expert tensors' names and shapes."""
    keys = sorted(k for k in config if k not in ("eos_token_id", "bos_token_id", "torch_dtype", "transformers_version",
                                                  "_name_or_path", "architectures"))
    arch = {k: config[k] for k in keys}
    blob = json.dumps([arch, list(tensors), [list(s) for s in shapes], num_layers, num_experts], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def shape_fingerprint(num_layers, num_experts):
    """The fingerprint of a model known only by its shape (routing imported from another
    engine, with no checkpoint to hash): a real checkpoint's fingerprint never equals it,
    so such a profile is used on a real model with --force, where the shapes agree."""
    return f"shape-{num_layers}x{num_experts}"


def prewarm_order(prior, num_layers, num_experts, cache_experts):
    """The keys a cache pre-warms at load, in order: the profile's activated experts,
    hottest first (`prior` may be None), then, where the cache holds every expert, all
    the others, as stock mlx-lm would have them."""
    order = [] if prior is None else prior.priority()
    if cache_experts >= num_layers * num_experts:
        hot = set(order)
        order += [(l, e) for l in range(num_layers) for e in range(num_experts) if (l, e) not in hot]
    return order


class ActivationProfile:
    def __init__(self, num_layers, num_experts, top_k, half_life=DEFAULT_HALF_LIFE, model="", model_fingerprint="",
                 workload="", counts=None, mass=None, tokens=0.0, tokens_total=0, created=None, curve=None,
                 expert_bytes=None, resident_bytes=None):
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.half_life = half_life
        self.model, self.fingerprint, self.workload = model, model_fingerprint, workload
        shape = (num_layers, num_experts)
        self.counts = np.zeros(shape) if counts is None else np.asarray(counts, dtype=np.float64).reshape(shape)
        self.mass = np.zeros(shape) if mass is None else np.asarray(mass, dtype=np.float64).reshape(shape)
        self.tokens = float(tokens)  # decayed like the counts
        self.tokens_total = int(tokens_total)
        self.created = created or time.time()
        self.curve = curve or {}
        self.expert_bytes, self.resident_bytes = expert_bytes, resident_bytes
        self.source = None  # the file it was loaded from, for messages

    @property
    def half_life(self):
        return self._half_life

    @half_life.setter
    def half_life(self, tokens):
        """Tokens after which a count weighs half (None or 0: no decay)."""
        if tokens is not None and not (isinstance(tokens, (int, float)) and math.isfinite(tokens) and tokens >= 0):
            raise MlxmoeError(f"half-life {tokens!r}: give a positive number of tokens")
        self._half_life = tokens
        self._decay = 2.0 ** (-1.0 / tokens) if tokens else 1.0

    def name(self):
        """How messages call this profile: its file, else its workload."""
        return self.source or f"profile {self.workload!r}"

    # Learning
    def tick(self, tokens=1):
        if self._decay != 1.0:
            d = self._decay ** tokens
            self.counts *= d
            self.mass *= d
            self.tokens *= d
        self.tokens += tokens
        self.tokens_total += tokens

    def observe(self, layer, experts, scores=None, probs=None):
        """One layer call: the distinct experts used, their router probabilities, and the
        router's full distribution when known (near misses then count a little)."""
        self.counts[layer, np.asarray(experts, dtype=np.intp)] += 1.0
        if probs is not None:
            self.mass[layer] += probs
        elif scores is not None:
            self.mass[layer, experts] += scores

    def absorb(self, other):
        """Learn `other`'s observations as if they came after this profile's (a server's
        request, recorded apart until its profile was chosen): this one decays by its
        tokens, then takes its counts."""
        self.check_compatible(other)
        d = self._decay ** other.tokens
        self.counts = self.counts * d + other.counts
        self.mass = self.mass * d + other.mass
        self.tokens = self.tokens * d + other.tokens
        self.tokens_total += other.tokens_total

    # Reading
    def rates(self):
        """Per-token use rate of each expert: the prior policies take."""
        return self.counts / self.tokens if self.tokens > 0 else np.zeros_like(self.counts)

    def top(self, n, layer=None):
        """The n hottest (layer, expert, rate), hottest first; of one layer if given."""
        rates = self.rates()
        if layer is not None:
            order = np.argsort(-rates[layer], kind="stable")[:n]
            return [(layer, int(e), float(rates[layer, e])) for e in order]
        order = np.argsort(-rates, axis=None, kind="stable")[:n]
        return [(int(i // self.num_experts), int(i % self.num_experts), float(rates.flat[i])) for i in order]

    def priority(self):
        """Every (layer, expert) with activations, hottest first: the pre-warm order."""
        return [(l, e) for l, e, r in self.top(self.counts.size) if r > 0]

    def hot_share(self, share=0.25):
        """Per layer, the share of activations carried by the hottest `share` of experts."""
        n = max(1, int(round(self.num_experts * share)))
        c = np.sort(self.counts, axis=1)[:, ::-1]
        totals = c.sum(axis=1)
        return np.divide(c[:, :n].sum(axis=1), totals, out=np.zeros_like(totals), where=totals > 0)

    # Combining
    def check_compatible(self, other):
        if (self.num_layers, self.num_experts) != (other.num_layers, other.num_experts):
            raise MlxmoeError(f"{other.name()} has {other.num_layers} layers x {other.num_experts} experts, "
                              f"{self.name()} {self.num_layers} x {self.num_experts}")

    @classmethod
    def merge(cls, profiles, weights=None, workload=None):
        """Weighted merge of rates: each profile counts as `weight` times its own tokens."""
        if not profiles:
            raise MlxmoeError("nothing to merge")
        weights = [1.0] * len(profiles) if weights is None else list(weights)
        if (len(weights) != len(profiles) or any(not math.isfinite(w) or w < 0 for w in weights)
                or not sum(weights)):
            raise MlxmoeError(f"merge weights {weights} must be one finite, non-negative number per profile "
                              "(not all 0)")
        first = profiles[0]
        for p in profiles[1:]:
            first.check_compatible(p)
            if p.fingerprint != first.fingerprint:
                raise MlxmoeError(f"cannot merge profiles of different models: {first.name()} is of "
                                  f"{first.model!r} (fingerprint {first.fingerprint}), {p.name()} of {p.model!r} "
                                  f"(fingerprint {p.fingerprint})")
        total = sum(w for w in weights)
        tokens = sum(w * p.tokens for w, p in zip(weights, profiles)) / total
        rates = sum(w * p.rates() for w, p in zip(weights, profiles)) / total
        mass = sum(w * (p.mass / p.tokens if p.tokens else np.zeros_like(p.mass))
                   for w, p in zip(weights, profiles)) / total
        return cls(first.num_layers, first.num_experts, first.top_k, first.half_life, first.model, first.fingerprint,
                   workload or " + ".join(p.workload for p in profiles), rates * tokens, mass * tokens, tokens,
                   sum(p.tokens_total for w, p in zip(weights, profiles) if w > 0), expert_bytes=first.expert_bytes,
                   resident_bytes=first.resident_bytes)

    def diff(self, other, n=5):
        """Per layer: Jensen-Shannon divergence (bits) of the two usage distributions (None
        where either profile has no activations there) and the experts whose rates differ
        most (expert, rate here, rate there)."""
        self.check_compatible(other)
        a, b = self.rates(), other.rates()
        out = []
        for l in range(self.num_layers):
            order = np.argsort(-np.abs(a[l] - b[l]), kind="stable")[:n]
            out.append({"layer": l, "js_divergence": js_divergence(a[l], b[l]),
                        "experts": [(int(e), float(a[l, e]), float(b[l, e])) for e in order]})
        return out

    # Files
    def to_json(self):
        return {
            "format": FORMAT, "model": self.model, "fingerprint": self.fingerprint, "workload": self.workload,
            "num_layers": self.num_layers, "num_experts": self.num_experts, "top_k": self.top_k,
            "decay": {"half_life_tokens": self.half_life}, "tokens": self.tokens, "tokens_total": self.tokens_total,
            "created": self.created, "expert_bytes": self.expert_bytes, "resident_bytes": self.resident_bytes,
            "counts": np.round(self.counts, 4).tolist(), "router_mass": np.round(self.mass, 4).tolist(),
            "curve": self.curve,
        }

    def save(self, path):
        """Write atomically: a temp file beside `path`, then rename (check_writable(path)
        beforehand spares a long recording a late failure)."""
        write_atomic(path, json.dumps(self.to_json(), indent=None, separators=(",", ":")))

    @classmethod
    def load(cls, path, fingerprint=None, force=False):
        """Read a profile; refuse one of another model unless `force` and the shapes agree."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise MlxmoeError(f"profile not found: {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MlxmoeError(f"{path}: not a valid profile (not JSON: {e})") from None
        except OSError as e:
            raise MlxmoeError(f"cannot read profile {path}: {e.strerror or e}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise MlxmoeError(f"{path}: not a {FORMAT} file")
        try:
            L, E = int(data["num_layers"]), int(data["num_experts"])
            counts = np.asarray(data["counts"], dtype=np.float64)
            mass = np.asarray(data.get("router_mass", np.zeros((L, E))), dtype=np.float64)
            for name, values in (("counts", counts), ("router_mass", mass)):
                if values.shape != (L, E):
                    raise ValueError(f"{name} is {list(values.shape)}, the header says {L} x {E}")
                if not np.isfinite(values).all() or (values < 0).any():
                    raise ValueError(f"{name} must be finite and non-negative")
            tokens = float(data["tokens"])
            if not math.isfinite(tokens) or tokens < 0:
                raise ValueError(f"tokens {tokens} must be finite and non-negative")
            decay = data.get("decay") or {}
            if not isinstance(decay, dict):
                raise ValueError(f"decay must be an object with half_life_tokens, not {decay!r}")
            half_life = decay.get("half_life_tokens")
            if half_life is not None and (isinstance(half_life, bool) or not isinstance(half_life, (int, float))):
                raise ValueError(f"half_life_tokens must be a number, not {half_life!r}")
            profile = cls(L, E, int(data.get("top_k", 0)), half_life,
                          data.get("model", ""), data.get("fingerprint", ""), data.get("workload", ""), counts, mass,
                          tokens, int(data.get("tokens_total", 0)), data.get("created"),
                          check_curve(data.get("curve") or {}), data.get("expert_bytes"), data.get("resident_bytes"))
        except (KeyError, TypeError, ValueError, MlxmoeError) as e:
            raise MlxmoeError(f"{path}: malformed profile ({e})") from None
        profile.source = str(path)
        if fingerprint is not None:
            profile.check_model(fingerprint, force=force, where=str(path))
        return profile

    def check_model(self, fingerprint, num_layers=None, num_experts=None, force=False, where=None):
        """Refuse this profile for a model with another fingerprint (unless `force`) or
        other layer and expert counts (always)."""
        where = where or f"profile {self.workload!r}"
        if self.fingerprint != fingerprint and not force:
            raise MlxmoeError(f"{where}: this profile was recorded on another model ({self.model!r}, "
                              f"fingerprint {self.fingerprint}); pass --force to use it anyway")
        if num_layers is not None and (self.num_layers, self.num_experts) != (num_layers, num_experts):
            raise MlxmoeError(f"{where}: the profile has {self.num_layers} layers x {self.num_experts} experts, "
                              f"the model {num_layers} x {num_experts}")


def check_curve(curve):
    """A profile's curve: {policy: [[cache experts, hit rate], ...]}."""
    if not isinstance(curve, dict):
        raise ValueError(f"curve must map policies to [experts, hit rate] points, not {type(curve).__name__}")
    for name, points in curve.items():
        if not isinstance(points, list) or not all(
                isinstance(pt, list) and len(pt) == 2 and all(isinstance(v, (int, float)) for v in pt) for pt in points):
            raise ValueError(f"curve of {name!r} must be a list of [experts, hit rate] points")
    return curve


def check_writable(path):
    """Fail now, before a long run, if `path` cannot be written at the end."""
    path = Path(path)
    if path.is_dir():
        raise MlxmoeError(f"cannot write {path}: it is a folder")
    if not path.parent.is_dir():
        raise MlxmoeError(f"cannot write {path}: folder {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK):
        raise MlxmoeError(f"cannot write {path}: folder {path.parent} is not writable")


def temp_beside(path):
    """A temp file in `path`'s folder (so the final rename is atomic), with the
    permissions a plain open() would give. Returns (fd, temp path)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise MlxmoeError(f"cannot write {path}: folder {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.chmod(tmp, 0o666 & ~umask())
    return fd, tmp


def write_atomic(path, text):
    """Write `text` (str or bytes) to `path` through a temp file beside it and a rename."""
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def js_divergence(p, q):
    """Jensen-Shannon divergence in bits between two (unnormalised) distributions."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if p.sum() <= 0 or q.sum() <= 0:
        return None  # undefined: a side with no activations
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(a, b):
        nz = a > 0
        return float((a[nz] * np.log2(a[nz] / b[nz])).sum())

    return (kl(p, m) + kl(q, m)) / 2


def lru_curve(steps_keys, sizes):
    """Hit rate of the runtime's LRU cache of each size in `sizes` on an access sequence
    given as steps (the distinct keys of one layer call each), from one pass of stack
    distances (a Fenwick tree over last-access positions). A step's keys count as
    accessed together, as the cache protects them from each other."""
    n = sum(len(step) for step in steps_keys)
    tree = [0] * (n + 1)

    def add(i, v):
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(i):  # sum over positions [0, i)
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    last = {}
    distances = []
    pos = 0
    for step in steps_keys:
        start = prefix(pos)
        for key in step:
            if key in last:  # distinct keys touched since, before this step
                distances.append(start - prefix(last[key] + 1))
        for key in step:
            if key in last:
                add(last[key], -1)
            add(pos, 1)
            last[key] = pos
            pos += 1
    distances = np.sort(np.asarray(distances, dtype=np.int64))
    return [(int(c), float(np.searchsorted(distances, c, side="left")) / n if n else 0.0) for c in sizes]


def write_heatmap_png(path, matrix, scale=None):
    """A layers x experts heatmap (dark = cold, yellow = hot), each layer on its own
    scale; one cell is `scale` pixels (default: about 768 pixels wide)."""
    m = np.asarray(matrix, dtype=np.float64)
    scale = scale or max(2, min(24, 768 // m.shape[1]))
    rows_max = m.max(axis=1, keepdims=True)
    v = np.divide(m, rows_max, out=np.zeros_like(m), where=rows_max > 0)  # each layer on its own scale
    stops = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)
    pos = v * (len(stops) - 1)
    lo = np.clip(pos.astype(int), 0, len(stops) - 2)
    frac = (pos - lo)[..., None]
    rgb = (stops[lo] * (1 - frac) + stops[lo + 1] * frac).astype(np.uint8)
    rgb = rgb.repeat(scale, axis=0).repeat(scale, axis=1)
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    write_atomic(path, png)


CURVE_SHARES = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0)


def curve_at(points, experts):
    """A policy's predicted hit rate at a cache of `experts` experts, read off its curve
    ([[experts, hit rate], ...] by size) by linear interpolation; None outside it."""
    for c, r in points:
        if c == experts:
            return r
    for (c0, r0), (c1, r1) in zip(points, points[1:]):
        if c0 < experts < c1:
            return r0 + (r1 - r0) * (experts - c0) / (c1 - c0)
    return None


def predicted_curve(header, records, policies=None, shares=CURVE_SHARES):
    """Hit rate vs cache size (experts) on a recorded access sequence for each online
    policy (default: all): LRU from one pass of stack distances, the others by replay."""
    from .policies import ONLINE
    from .trace import replay, steps

    policies = ONLINE if policies is None else policies

    total = header["num_layers"] * header["num_experts"]
    k = max((len(set(r[3])) for r in records), default=1)
    sizes = sorted({max(k, int(round(total * s))) for s in shares})
    keys = [[(l, x) for x in experts] for _, l, experts, *_ in steps(records, header["num_layers"])]
    widest = max((len(step) for step in keys), default=0)
    curve = {}
    for name in policies:
        if name == "lru":
            # a cache smaller than a layer call's experts (a prefill) splits the call into runs
            # that fit it, which the stack distances of whole calls do not see: replay those sizes
            curve[name] = lru_curve(keys, [c for c in sizes if c >= widest]) + [
                (c, replay(header, records, name, c)["hit_rate"]) for c in sizes if c < widest]
            curve[name].sort()
        else:
            curve[name] = [(c, replay(header, records, name, c)["hit_rate"]) for c in sizes]
    return {name: [[c, round(r, 4)] for c, r in points] for name, points in curve.items()}
