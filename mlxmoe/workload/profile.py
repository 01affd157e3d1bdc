"""ActivationProfile: which experts a workload uses, saved as `mlxmoe.profile/1` JSON.

Per (layer, expert): activation counts and router probability mass, both decayed with a
half-life in tokens (so a profile follows a workload that changes), the decayed number
of tokens they came from, and the model's fingerprint. Rates (counts / tokens) are what
policies take as their prior. A profile can carry a predicted hit-rate-vs-cache-size
curve computed from the access sequence it was recorded from (curves.py).
"""

import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np

from ..errors import MlxmoeError
from ..storage.files import read_bytes, write_atomic
from ..caching.policies import HALF_LIFE_PROFILE, hottest

FORMAT = "mlxmoe.profile/1"
MAX_CELLS = 1 << 22  # layers x experts a profile may claim (the largest MoE models have ~50 000)
MAX_INT = 1 << 62  # token counts, bytes: anything above is not a real value (and overflows numpy)
MAX_FILE_BYTES = 256 << 20  # a profile of MAX_CELLS experts with both matrices fits in ~100 MB


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
    def __init__(self, num_layers, num_experts, top_k, half_life=HALF_LIFE_PROFILE, model="", model_fingerprint="",
                 workload="", counts=None, mass=None, tokens=0.0, tokens_total=0, created=None, curve=None,
                 expert_bytes=None, resident_bytes=None, recommended_cache_bias=None):
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.half_life = half_life
        self.model, self.fingerprint, self.workload = model, model_fingerprint, workload
        shape = (num_layers, num_experts)
        self.counts = np.zeros(shape) if counts is None else np.asarray(counts, dtype=np.float64).reshape(shape)
        self.unread = None  # mass learnt elsewhere, added at the next read of `mass` (take(): experts.DeviceMass)
        self.mass = np.zeros(shape) if mass is None else np.asarray(mass, dtype=np.float64).reshape(shape)
        self.tokens = float(tokens)  # decayed like the counts
        self.tokens_total = int(tokens_total)
        self.created = created or time.time()
        self.curve = curve or {}
        self.expert_bytes, self.resident_bytes = expert_bytes, resident_bytes
        # the --cache-bias this profile's workload was measured to take (profile record --recommend-bias; used
        # by --cache-bias profile only)
        self.recommended_cache_bias = recommended_cache_bias
        self.source = None  # the file it was loaded from, for messages

    @property
    def half_life(self):
        return self._half_life

    @half_life.setter
    def half_life(self, tokens):
        """Tokens after which a count weighs half (None or 0: no decay)."""
        if tokens is not None and not (isinstance(tokens, (int, float)) and math.isfinite(tokens) and tokens >= 0):
            raise MlxmoeError(f"half-life {tokens!r}: give a positive number of tokens")
        if tokens is not None and 0 < tokens < 1:  # (a profile that forgets within a token; load refuses it)
            raise MlxmoeError(f"half-life {tokens!r}: 0 (no decay) or at least 1 token")
        if getattr(self, "unread", None) is not None:
            self.mass  # (unread mass decays at the rate it was learnt at)
        self._half_life = tokens
        self._decay = 2.0 ** (-1.0 / tokens) if tokens else 1.0

    @property
    def mass(self):
        """The router probability mass [layers, experts], decayed like the counts; what is
        unread is added first."""
        unread = self.unread.take() if self.unread is not None else None
        if unread is not None:
            self._mass += unread
        return self._mass

    @mass.setter
    def mass(self, value):
        if self.unread is not None:  # (replaced: what was unread goes too)
            self.unread.take()
        self._mass = value

    def decay(self, tokens):
        """What a count keeps over `tokens` more tokens."""
        return self._decay ** tokens

    def name(self):
        """How messages call this profile: its file, else its workload."""
        return self.source or f"profile {self.workload!r}"

    # Learning
    def tick(self, tokens=1):
        if self._decay != 1.0:
            d = self._decay ** tokens
            self.counts *= d
            self._mass *= d  # (unread mass is decayed at its read: DeviceMass)
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

    def learn(self, call):
        """One layer call (an experts.LayerCall): its tokens at the first layer, then observe."""
        if call.ticked:
            self.tick(call.ticked)
        self.observe(call.layer, call.experts, call.scores, call.mean)

    def learn_calls(self, calls):
        """learn() of each of `calls` in order: in three numpy calls where they are of
        distinct layers, each with its router distribution, only the first one ticking
        (a decode step's); one by one otherwise. Each element gets the same additions."""
        layers = [c.layer for c in calls]
        if len(set(layers)) < len(layers) or any(c.mean is None for c in calls) or any(c.ticked for c in calls[1:]):
            for call in calls:
                self.learn(call)
            return
        self.observe_step(layers, np.repeat(layers, [len(c.experts) for c in calls]),
                          np.concatenate([np.asarray(c.experts, dtype=np.intp) for c in calls]),
                          np.stack([c.mean for c in calls]), calls[0].ticked)

    def observe_step(self, layers, at_layers, experts, mass, ticked=0):
        """A decode step's layer calls at once, of distinct `layers`: `ticked` tokens start
        with the first, each distinct expert `experts[i]` of layer `at_layers[i]` counted, the
        router's distribution of each of `layers` (`mass`, where given) added."""
        if ticked:
            self.tick(ticked)
        self.counts[at_layers, experts] += 1.0
        if mass is not None:  # (else learnt on the device: DeviceMass)
            self.mass[layers] += mass

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
        return [(l, e, float(rates[l, e])) for l, e in hottest(rates, n, layer)]

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
        weights = [w / max(weights) for w in weights]  # the same merge, with sums that cannot overflow
        total = sum(weights)
        tokens = sum(w * p.tokens for w, p in zip(weights, profiles)) / total
        rates = sum(w * p.rates() for w, p in zip(weights, profiles)) / total
        mass = sum(w * (p.mass / p.tokens if p.tokens else np.zeros_like(p.mass))
                   for w, p in zip(weights, profiles)) / total
        return cls(first.num_layers, first.num_experts, first.top_k, first.half_life, first.model, first.fingerprint,
                   workload or " + ".join(p.workload for p in profiles), rates * tokens, mass * tokens, tokens,
                   sum(p.tokens_total for w, p in zip(weights, profiles) if w > 0), expert_bytes=first.expert_bytes,
                   resident_bytes=first.resident_bytes,
                   recommended_cache_bias=first.recommended_cache_bias  # where all agree
                   if all(p.recommended_cache_bias == first.recommended_cache_bias for p in profiles) else None)

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
        bias = self.recommended_cache_bias  # (absent where none: written as before)
        return {
            "format": FORMAT, "model": self.model, "fingerprint": self.fingerprint, "workload": self.workload,
            "num_layers": self.num_layers, "num_experts": self.num_experts, "top_k": self.top_k,
            "decay": {"half_life_tokens": self.half_life}, "tokens": self.tokens, "tokens_total": self.tokens_total,
            "created": self.created, "expert_bytes": self.expert_bytes, "resident_bytes": self.resident_bytes,
            "counts": np.round(self.counts, 4).tolist(), "router_mass": np.round(self.mass, 4).tolist(),
            "curve": self.curve, **({} if bias is None else {"recommended_cache_bias": bias}),
        }

    def save(self, path):
        """Write atomically: a temp file beside `path`, then rename (check_writable(path)
        beforehand spares a long recording a late failure). What load() would refuse
        (counts that overflowed a merge) is refused here, naming `path`."""
        data = self.to_json()
        try:
            parse(data)
        except (KeyError, TypeError, ValueError, OverflowError, MlxmoeError) as e:
            raise MlxmoeError(f"cannot write {path}: the profile is not valid ({e})") from None
        write_atomic(path, json.dumps(data, indent=None, separators=(",", ":"), allow_nan=False))

    @classmethod
    def load(cls, path, fingerprint=None, force=False):
        """Read a profile; refuse one of another model unless `force` and the shapes agree."""
        path = Path(path)
        raw = read_bytes(path, "profile", MAX_FILE_BYTES)
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MlxmoeError(f"{path}: not a valid profile (not JSON: {e})") from None
        except RecursionError:
            raise MlxmoeError(f"{path}: not a valid profile (JSON nested too deeply)") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise MlxmoeError(f"{path}: not a {FORMAT} file")
        try:
            profile = cls(**parse(data))
        except (KeyError, TypeError, ValueError, OverflowError, MlxmoeError) as e:
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


def _number(data, key, default, kind=(int, float), low=0, optional=False):
    """data[key] (or `default` where absent) as a finite number >= low of `kind`; None
    where `optional` and null."""
    value = data.get(key, default)
    if value is None and optional:
        return None
    if (isinstance(value, bool) or not isinstance(value, kind) or value < low
            or (isinstance(value, float) and not math.isfinite(value)) or value > MAX_INT):
        kinds = "an integer" if kind is int else "a number"
        raise ValueError(f"{key} must be {kinds} between {low} and {MAX_INT}, not {str(value)[:40]}")
    return value


def _matrix(data, key, shape):
    """data[key] as a finite, non-negative float64 array of `shape` (checked before it
    is converted, so that a deep or ragged value is refused cheaply)."""
    rows = data[key]
    if not (isinstance(rows, list) and len(rows) == shape[0]
            and all(isinstance(row, list) and len(row) == shape[1] for row in rows)):
        outer = [len(rows)] if isinstance(rows, list) else []
        inner = [len(rows[0])] if outer and rows and isinstance(rows[0], list) else []
        raise ValueError(f"{key} is {outer + inner}, the header says {shape[0]} x {shape[1]}")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for row in rows for v in row):
        raise ValueError(f"{key} must hold numbers only")
    values = np.asarray(rows, dtype=np.float64)
    if not np.isfinite(values).all() or (values < 0).any():
        raise ValueError(f"{key} must be finite and non-negative")
    return values


def parse(data):
    """The constructor's arguments from a profile's JSON object, every field checked
    (type, range, shape) so that nothing malformed fails later."""
    L, E = _number(data, "num_layers", None, int, 1), _number(data, "num_experts", None, int, 1)
    if L * E > MAX_CELLS:
        raise ValueError(f"{L} layers x {E} experts is more than {MAX_CELLS} experts")
    for key in ("model", "fingerprint", "workload"):
        if not isinstance(data.get(key, ""), str):
            raise ValueError(f"{key} must be a string, not {data[key]!r}")
    decay = data.get("decay") or {}
    if not isinstance(decay, dict):
        raise ValueError(f"decay must be an object with half_life_tokens, not {decay!r}")
    top_k = _number(data, "top_k", 0, int)
    if "top_k" in data and not 1 <= top_k <= E:
        raise ValueError(f"top_k {top_k}: a token routes to 1 to the {E} experts of a layer")
    half_life = _number(decay, "half_life_tokens", None, low=-math.inf, optional=True)
    if half_life is not None and half_life < 0:
        raise ValueError(f"half-life {half_life!r}: give a positive number of tokens")
    if half_life is not None and 0 < half_life < 1:
        raise ValueError(f"half_life_tokens {half_life}: 0 (no decay) or at least 1 token")
    counts, tokens = _matrix(data, "counts", (L, E)), float(_number(data, "tokens", None))
    fields = dict(num_layers=L, num_experts=E, top_k=top_k, half_life=half_life, model=data.get("model", ""),
                model_fingerprint=data.get("fingerprint", ""), workload=data.get("workload", ""),
                counts=counts,
                mass=_matrix(data, "router_mass", (L, E)) if "router_mass" in data else None,
                tokens=tokens, tokens_total=_number(data, "tokens_total", 0, int),
                created=_number(data, "created", None, optional=True), curve=check_curve(data.get("curve") or {}, L * E),
                expert_bytes=_number(data, "expert_bytes", None, int, 1, optional=True),
                resident_bytes=_number(data, "resident_bytes", None, int, 1, optional=True),
                recommended_cache_bias=_number(data, "recommended_cache_bias", None, optional=True))
    # an expert is counted at most once per token and layer, decayed as the tokens are: a rate above 1 is corrupt
    most = float(counts.max(initial=0))
    if most > tokens * (1 + 1e-6) + 1e-3:
        raise ValueError(f"counts up to {most:.6g} over {tokens:.6g} tokens: an expert counted more than once a token")
    return fields


def check_curve(curve, total=MAX_CELLS):
    """A profile's curve: {policy: [[cache experts, hit rate], ...]}, the sizes integers
    from 0 to the model's `total` experts, rising, the same for every policy; hit rates
    in [0, 1]."""
    if not isinstance(curve, dict):
        raise ValueError(f"curve must map policies to [experts, hit rate] points, not {type(curve).__name__}")
    sizes = None
    for name, points in curve.items():
        if not isinstance(points, list) or not all(
                isinstance(pt, (list, tuple)) and len(pt) == 2
                and isinstance(pt[0], int) and not isinstance(pt[0], bool) and 0 <= pt[0] <= total
                and isinstance(pt[1], (int, float)) and not isinstance(pt[1], bool) and 0 <= pt[1] <= 1
                for pt in points):
            raise ValueError(f"curve of {name!r} must be a list of [experts, hit rate] points (experts an integer "
                             f"from 0 to the model's {total}, hit rates between 0 and 1)")
        mine = [pt[0] for pt in points]
        if any(a >= b for a, b in zip(mine, mine[1:])):
            raise ValueError(f"curve of {name!r}: the cache sizes {mine[:8]} must rise")
        if sizes is not None and mine != sizes:
            raise ValueError(f"curve of {name!r}: cache sizes {mine[:8]}, those of {next(iter(curve))!r} "
                             f"{sizes[:8]} (every policy is read at the same sizes)")
        sizes = mine
    return curve


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
