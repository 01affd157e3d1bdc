"""Opt-in lossy routing at decode steps, where a miss costs a read on the decode thread.

- Top-k trimming (`trim` W): a routed expert that is not resident and whose share of the
  token's routing weight (renormalised over its top-k) is below W is skipped for this
  token; the others keep the weights the model's own rule gives them without it
  (renormalised where the model renormalises its top-k, as is where it does not).
  Its second form, `trim_mass` M: a routed expert that is not resident is skipped where the
  experts with a larger share carry M of the weight already (the top ones covering M are
  kept; oMLX's adaptive top-k at 0.85 of the routing mass). Both may be given: either skips.
- Cache-aware routing (`cache_bias` B): resident experts' router logits + B before the
  model's top-k, so a close call goes to an expert already in memory; the chosen experts
  are then weighted from the router's own logits (B changes which experts, not how much).

Both act through one scale per routed expert on the experts' outputs: the model's MoE
block multiplies each expert's output by its routing weight and sums, so an output scaled
by (wanted weight / applied weight) gives the wanted sum, and 0 drops the expert. Exact
(both 0) is the default, and then nothing here runs. A prefill is exact: it reads each
expert of a layer once for all its tokens anyway. A prefetcher's lookahead guesses follow
the same rule (Lossy.guesses): a read the layer would not use is not made.
"""

import math

import mlx.core as mx
import numpy as np

from ..backend import host_floats
from ..errors import MlxmoeError

# How mlx-lm's MoE block of each model type weights the experts it routed a token to from
# its router's logits: "topk", softmax over the chosen experts' logits (renormalised);
# "softmax", softmax over all experts, not renormalised; "norm_topk_prob": "topk" where
# config.json's norm_topk_prob is true, else "softmax" (mlx-lm's qwen3_moe and olmoe).
RULES = {"mixtral": "topk", "gpt_oss": "topk", "qwen2_moe": "softmax", "qwen3_moe": "norm_topk_prob",
         "olmoe": "norm_topk_prob"}


def check_options(trim, cache_bias, trim_mass=0.0):
    """load's lossy options, with the CLI's ranges."""
    if isinstance(trim, bool) or not isinstance(trim, (int, float)) or not 0 <= trim <= 1:
        raise MlxmoeError(f"trim {trim!r}: a share of a token's routing weight, from 0 (off) to 1")
    if isinstance(trim_mass, bool) or not isinstance(trim_mass, (int, float)) or not 0 <= trim_mass <= 1:
        raise MlxmoeError(f"trim_mass {trim_mass!r}: the share of a token's routing weight its top experts keep, "
                          "from 0 (off) to 1")
    if cache_bias != "profile" and (isinstance(cache_bias, bool) or not isinstance(cache_bias, (int, float))
                                    or not math.isfinite(cache_bias) or cache_bias < 0):
        raise MlxmoeError(f"cache_bias {cache_bias!r}: a bonus on resident experts' router logits, 0 (off) or more, "
                          "or 'profile' (the profile's recommended one)")


def profile_bias(profile) -> float:
    """cache_bias="profile": the profile's recommended cache bias, or an MlxmoeError saying
    what is missing."""
    if profile is None:
        raise MlxmoeError("cache_bias 'profile' takes the recommended cache bias of a profile: give one "
                          "(--profile FILE), or give the bias as a number")
    if profile.recommended_cache_bias is None:
        raise MlxmoeError(f"{profile.name()}: this profile recommends no cache bias (`mlxmoe profile "
                          "record --recommend-bias B` records one); give --cache-bias a number")
    return float(profile.recommended_cache_bias)


def routing_rule(path, config, what):
    """The weighting rule (RULES) of config.json's model type, or an MlxmoeError naming it."""
    model_type = config.get("model_type")
    rule = RULES.get(model_type)
    if rule is None:
        raise MlxmoeError(f"{path}: {what} is not supported for model_type {model_type!r} (its router is not a "
                          f"softmax mlxmoe can reweight); supported: {', '.join(sorted(RULES))}")
    if rule == "norm_topk_prob":
        rule = "topk" if config.get("norm_topk_prob", False) else "softmax"
    return rule


def refuse_tensor_split(ckpt, what):
    """Under the tensor split every rank computes a slice of the same experts: a choice made
    from one rank's own cache would differ between ranks."""
    if ckpt.group is not None and ckpt.split == "tensor":
        raise MlxmoeError(f"{ckpt.path}: {what} decides from the cache's residency, which differs between the "
                          "ranks of a tensor split; use the pipeline split or one process")


class Lossy:
    """A model's lossy settings and what they did (its counters are the cache's)."""

    def __init__(self, rule: str, trim: float = 0.0, cache_bias: float = 0.0, trim_mass: float = 0.0) -> None:
        self.rule, self.trim, self.cache_bias, self.trim_mass = rule, float(trim), float(cache_bias), float(trim_mass)

    def trimmed(self, share: np.ndarray, stronger: np.ndarray) -> np.ndarray:
        """Whether trimming would skip each expert, if not resident: its `share` of the token's
        routed weight, `stronger` the share of the routed experts with a larger one."""
        out = share < self.trim
        if self.trim_mass:
            out |= stronger >= self.trim_mass
        return out

    def kept(self, share: np.ndarray, resident: list) -> list:
        """Which routed experts a token keeps, from each one's `share` of its routed weight:
        the `resident` ones and those trimming spares; its strongest where none would be."""
        stronger = (share[None, :] * (share[None, :] > share[:, None])).sum(axis=1)
        keep = [bool(r or not t) for r, t in zip(resident, self.trimmed(share, stronger))]
        if not any(keep):
            keep[int(np.argmax(share))] = True
        return keep

    def step(self, logits: np.ndarray, row: list, resident: list, mask: np.ndarray | None):
        """One token's routing at a layer: the router's own `logits` [experts], its routed
        experts `row`, whether each is `resident`, the resident mask the router's logits were
        biased with (None: not biased; StreamingExperts does not call it for a token whose
        experts are all resident and unbiased). Returns (keep [bool per routed expert], scales [float
        per routed expert] or None where the outputs need none, experts biased into the
        choice)."""
        chosen = np.asarray(row)
        w = _softmax(logits[chosen]) if self.rule == "topk" else _softmax(logits)[chosen]
        keep = self.kept(w / w.sum(), resident)
        if all(keep) and mask is None:
            return keep, None, 0
        wanted = np.where(keep, w, 0.0)
        if self.rule == "topk":
            wanted /= wanted.sum()
        biased = 0
        applied = w
        if mask is not None:
            z = logits + self.cache_bias * mask
            applied = _softmax(z[chosen]) if self.rule == "topk" else _softmax(z)[chosen]
            top = np.argpartition(-logits, len(row) - 1)[:len(row)]
            biased = len(set(row) - set(top.tolist()))
        return keep, (wanted / applied).tolist(), biased

    def guesses(self, probs: np.ndarray, layer: int, slot_of, k: int):
        """A prefetcher's lookahead of `layer`'s next call, its router's distribution `probs`
        [experts], as the layer will route it with the cache's residency now (`slot_of`, as
        RouterBias reads it): (the distribution with resident experts' logits + cache_bias,
        softmax(logits + B mask) = probs e^(B mask) renormalised; the experts not worth a read,
        those trimming would skip: not resident, with too small a share of the predicted top
        `k`, an expert outside it taking the place of its weakest)."""
        resident = np.array([(layer, e) in slot_of for e in range(len(probs))])
        ranked = probs
        if self.cache_bias and 0 < resident.sum() < len(probs):
            ranked = probs * np.exp(self.cache_bias * resident)
            ranked /= ranked.sum()
        if not (self.trim or self.trim_mass):
            return ranked, ()
        row = np.argsort(-ranked, kind="stable")[:k]
        p = probs.astype(np.float64)
        top = np.sort(p[row])[::-1]
        others = np.full(len(p), top.sum() - top[-1])  # what an expert outside the top k is routed beside
        others[row] = top.sum() - p[row]
        total = others + p
        mass = np.concatenate([[0.0], np.cumsum(top)])[np.searchsorted(-top, -p, side="left")]
        stronger = np.minimum(mass, others) / total  # (outside the top k: its weakest left out)
        skip = ~resident & self.trimmed(p / total, stronger)
        if skip[row].all():  # as a layer keeps its strongest where it would keep none
            skip[row[np.argmax(p[row])]] = False
        return ranked, set(np.flatnonzero(skip).tolist())


def _softmax(z):
    z = np.exp(z - z.max())
    return z / z.sum()


def host_logits(logits: mx.array) -> np.ndarray:
    """An evaluated one-token logits array as float64 numpy [experts]."""
    return host_floats(logits).reshape(-1).astype(np.float64)


class RouterBias:
    """What a biased router needs: the cache whose residency it favours, its layer, the bonus."""

    def __init__(self, cache, layer: int, bonus: float, num_experts: int) -> None:
        self.cache, self.layer, self.bonus, self.num_experts = cache, layer, bonus, num_experts

    def mask(self) -> np.ndarray | None:
        """The layer's residency now [experts] (1.0 resident or on its way), None where all
        or none are (a uniform bonus changes nothing: the logits are left exact)."""
        slot_of, layer = self.cache.slot_of, self.layer
        m = np.array([(layer, e) in slot_of for e in range(self.num_experts)], dtype=np.float64)
        n = int(m.sum())
        return None if n in (0, len(m)) else m


def _biased(cls):
    """A subclass of a tapped router's class (experts._tapped) whose one-token calls add
    the bonus to resident experts' logits; its last_logits stay the router's own, and
    last_mask is the mask it applied (None: none)."""

    def __call__(self, x):
        logits = cls.__call__(self, x)
        self.last_mask = self.router_bias.mask() if x.size == x.shape[-1] else None
        if self.last_mask is None:
            return logits
        return logits + mx.array(self.last_mask * self.router_bias.bonus, dtype=logits.dtype)

    return type(f"Biased{cls.__name__}", (cls,), {"__call__": __call__})


def attach_lossy(ckpt, cache, trim: float, cache_bias, trim_mass: float = 0.0, profile=None) -> Lossy | None:
    """Give every StreamingExperts of `ckpt` the Lossy settings, and bias their routers by
    `cache_bias` (a number, or "profile": `profile`'s recommended one), and the cache's
    prefetcher the settings its guesses follow; None (nothing changed) where all are 0. An
    MlxmoeError names a model type whose routing cannot be reweighted so."""
    check_options(trim, cache_bias, trim_mass)
    if cache_bias == "profile":
        cache_bias = profile_bias(profile)
    if not trim and not cache_bias and not trim_mass:
        return None
    what = " and ".join(n for n, v in (("top-k trimming", trim or trim_mass), ("cache-aware routing", cache_bias))
                        if v)
    refuse_tensor_split(ckpt, what)
    lossy = Lossy(routing_rule(ckpt.path, ckpt.config, what), trim, cache_bias, trim_mass)
    for streaming in ckpt.experts:
        gate = getattr(streaming._router, "gate", None)
        if gate is None:
            raise MlxmoeError(f"{ckpt.path}: {what} needs the router's logits, and model_type "
                              f"{ckpt.config.get('model_type')!r} has no linear router mlxmoe can tap")
        if cache_bias:
            gate.router_bias = RouterBias(cache, streaming._layer, cache_bias, ckpt.num_experts)
            gate.last_mask = None
            gate.__class__ = _biased(type(gate))
        streaming._lossy = lossy
    if cache.prefetcher is not None:
        cache.prefetcher.lossy = lossy
    return lossy
