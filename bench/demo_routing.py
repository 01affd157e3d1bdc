"""Is the demo model's routing workload-specific? Evidence on held-out text.

    python bench/demo_routing.py            # the committed held-out samples (bench/data/heldout/)
    python bench/demo_routing.py --full     # the whole held-out split, rebuilt from the Debian
                                            # packages with demo/train_demo.py's own code

Loads the bundled model (mlxmoe/demo) with mlx-lm, records every router's top-k choices on
held-out text of each language (English, Italian, French, German, Spanish) and kind (man
pages, fortunes), and prints per MoE layer:

- the Jensen-Shannon divergence (base 2: 0 = same expert usage, 1 = disjoint experts)
  between the Italian and the English expert-usage distributions, a table for every pair
  of languages, and a noise floor (JS between two halves of the same language's text);
- the share of expert activations carried by each language's hottest 25 % of experts, next
  to the same figure for Qwen3-30B-A3B (bench/data/qwen3-30b-a3b-expert-heat.json) and
  for the languages mixed together (what the load-balancing loss flattened);
- held-out perplexity per language against a unigram model fitted on the training split
  (add-one smoothing), and nats per character, which compares models whose tokenizers differ

Results also go to bench/out/demo_routing.json. The held-out text was never trained on
(train_demo.py holds out ~5 % of the documents by md5 of their name). The 4-bit weights are
dequantized to float32 before running (the same weights; MLX's CPU quantized matmul is
~20x slower than float); --quantized runs them as shipped.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "demo"))  # train_demo.py, the demo model's builder

import train_demo as td  # noqa: E402
from system import check_outputs, model_folder, write_json  # noqa: E402
from traces import HEAT  # noqa: E402

NAMES = {"en": "English", "it": "Italian", "fr": "French", "de": "German", "es": "Spanish"}


def js_divergence(p, q):
    """Jensen-Shannon divergence in bits between two count (or probability) vectors."""
    p = np.asarray(p, np.float64) / np.sum(p)
    q = np.asarray(q, np.float64) / np.sum(q)
    m = 0.5 * (p + q)

    def kl(a, b):
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / b[nz])))

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def hot_share(counts, fraction=0.25):
    """Share of activations carried by the hottest `fraction` of experts."""
    c = np.sort(np.asarray(counts, np.float64))[::-1]
    k = max(1, int(round(fraction * len(c))))
    return float(c[:k].sum() / c.sum())


def normalized(counts):
    c = np.asarray(counts, np.float64)
    return c / c.sum(axis=-1, keepdims=True)


def qwen_reference(path=HEAT):
    if not path.exists():
        return None
    with open(path) as f:
        d = json.load(f)
    shares = [hot_share(layer) for layer in d["heat"]]
    return {"model": d["model"], "layers": d["num_layers"], "experts": d["num_experts"], "top_k": d["top_k"],
            "hot25_per_layer": [round(s, 4) for s in shares], "hot25_mean": float(np.mean(shares)),
            "hot25_min": float(np.min(shares)), "hot25_max": float(np.max(shares))}


def load_texts(full, work, folder=td.HELDOUT_DIR):
    """{"it.man": [documents], ...}: the committed samples, or the whole held-out split."""
    texts = {}
    if full:
        corpus, _ = td.build_corpus(work)
        for lang in td.LANGS:
            for kind in td.KINDS:
                if corpus[lang][kind]["heldout"]:
                    texts[f"{lang}.{kind}"] = corpus[lang][kind]["heldout"]
        return texts
    for lang in td.LANGS:
        for kind in td.KINDS:
            f = Path(folder) / f"{lang}.{kind}.txt"
            if f.exists():
                docs = [d for d in f.read_text(encoding="utf-8").split(td.EOT) if d.strip()]
                texts[f"{lang}.{kind}"] = docs
    if not texts:
        raise SystemExit(f"no held-out samples in {folder}: run demo/train_demo.py, or use --full")
    return texts


def run_model(model, ids, seq_len, top_k, batch=8, max_tokens=None):
    """Per-window routing counts [windows, layers, experts] and per-token NLL (nats) of `ids`."""
    import mlx.core as mx
    import mlx.nn as nn

    ids = np.asarray(ids if max_tokens is None else ids[: max_tokens + 1])
    n = (len(ids) - 1) // seq_len
    rest = (len(ids) - 1) - n * seq_len
    windows = [(i * seq_len, seq_len) for i in range(n)]
    if rest >= 16:  # the tail as a shorter window
        windows.append((n * seq_len, rest))
    counts, nll, targets = [], [], []
    for i in range(0, len(windows), batch):
        group = windows[i:i + batch]
        by_len = {}
        for w in group:
            by_len.setdefault(w[1], []).append(w)
        for length, ws in by_len.items():
            x = np.stack([ids[s:s + length] for s, _ in ws])
            y = np.stack([ids[s + 1:s + length + 1] for s, _ in ws])
            with td.record_gates(model) as rec:
                logits = model(mx.array(x))
                loss = nn.losses.cross_entropy(logits, mx.array(y), reduction="none")
                per_window = []
                for r in rec:  # [B, L, E] -> top-k counts per window
                    p = mx.softmax(r.astype(mx.float32), axis=-1)
                    kth = mx.sort(p, axis=-1)[..., -top_k]
                    per_window.append((p >= kth[..., None]).astype(mx.float32).sum(axis=1))
                c = mx.stack(per_window, axis=1)  # [B, layers, E]
            mx.eval(loss, c)
            counts.append(np.array(c))
            nll.append(np.array(loss).reshape(-1))
            targets.append(y.reshape(-1))
    return np.concatenate(counts), np.concatenate(nll), np.concatenate(targets)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(td.DEMO_DIR))
    parser.add_argument("--full", action="store_true", help="The whole held-out split, rebuilt from Debian packages.")
    parser.add_argument("--heldout-dir", default=str(td.HELDOUT_DIR), help="Held-out samples and unigram counts.")
    parser.add_argument("--work", default=str(td.DEFAULT_WORK), help="train_demo.py's corpus cache (with --full).")
    parser.add_argument("--max-tokens", type=int, default=40_000, help="Per language and kind (with --full).")
    parser.add_argument("--quantized", action="store_true", help="Run the 4-bit kernels as shipped (slow on CPU).")
    parser.add_argument("--out", default=str(REPO / "bench" / "out" / "demo_routing.json"))
    args = parser.parse_args(argv)
    check_outputs({"--out": args.out}, {"--model": model_folder(args.model), "--heldout-dir": args.heldout_dir,
                                        "--work": args.work if args.full else None})
    td.ensure_fast_blas(install=False)  # Debian's OpenBLAS when installed (see train_demo.py)

    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    t0 = time.time()
    model, tokenizer = load(args.model)
    if not args.quantized:
        model = dequantize_model(model)
    with open(Path(args.model) / "config.json") as f:
        config = json.load(f)
    top_k, n_exp = config["num_experts_per_tok"], config["num_experts"]
    seq_len = 256

    texts = load_texts(args.full, Path(args.work), args.heldout_dir)
    counts, nll, targets, chars = {}, {}, {}, {}
    for key, docs in texts.items():
        ids = tokenizer.encode(td.EOT.join(docs) + td.EOT, add_special_tokens=False)
        c, l, t = run_model(model, ids, seq_len, top_k, max_tokens=args.max_tokens if args.full else None)
        counts[key], nll[key], targets[key] = c, l, t
        # the characters the scored tokens spell: per character, models with different
        # tokenizers compare on the same text (the decoding gives the text back exactly)
        chars[key] = len(tokenizer.decode(ids[: len(t) + 1]))

    # A language's expert usage: its kinds weighted equally (French has man pages only).
    langs = [lang for lang in td.LANGS if any(k.startswith(lang + ".") for k in counts)]
    lang_usage = {lang: np.mean([normalized(counts[k].sum(0)) for k in counts if k.startswith(lang + ".")], axis=0)
                  for lang in langs}
    n_layers = next(iter(counts.values())).shape[1]
    lang_counts = {lang: np.concatenate([counts[k] for k in counts if k.startswith(lang + ".")]) for lang in langs}

    def halves_js(windows):
        """JS between the even and the odd windows of one text: the sampling-noise floor."""
        a, b = windows[0::2].sum(0), windows[1::2].sum(0)
        return [js_divergence(a[layer], b[layer]) for layer in range(n_layers)]

    res = {"model": str(args.model), "heldout": "full split" if args.full else "bench/data/heldout samples",
           "weights": "4-bit kernels" if args.quantized else "4-bit weights dequantized to float32",
           "tokens": {k: int(len(v)) for k, v in targets.items()}, "layers": n_layers, "experts": n_exp,
           "top_k": top_k}

    # --- JS divergence
    js_it_en = [js_divergence(lang_usage["it"][layer], lang_usage["en"][layer]) for layer in range(n_layers)]
    pairs = {}
    for i, a in enumerate(langs):
        for b in langs[i + 1:]:
            pairs[f"{a}-{b}"] = [js_divergence(lang_usage[a][layer], lang_usage[b][layer]) for layer in range(n_layers)]
    same_kind = {}
    for kind in td.KINDS:
        if f"it.{kind}" in counts and f"en.{kind}" in counts:
            same_kind[kind] = [js_divergence(counts[f"it.{kind}"].sum(0)[layer], counts[f"en.{kind}"].sum(0)[layer])
                               for layer in range(n_layers)]
    kind_js = {lang: [js_divergence(counts[f"{lang}.man"].sum(0)[layer], counts[f"{lang}.fortune"].sum(0)[layer])
                      for layer in range(n_layers)]
               for lang in langs if f"{lang}.man" in counts and f"{lang}.fortune" in counts}
    noise = {lang: halves_js(lang_counts[lang]) for lang in ("it", "en") if lang in lang_counts}
    res["js_it_en"] = js_it_en
    res["js_it_en_same_kind"] = same_kind
    res["js_pairs"] = pairs
    res["js_man_vs_fortune_same_language"] = kind_js
    res["js_noise_floor_halves"] = noise

    print(f"demo model {args.model}: {n_layers} MoE layers x {n_exp} experts, top-{top_k}; "
          f"held-out text: {res['heldout']}, {sum(res['tokens'].values())} tokens "
          f"({', '.join(f'{k} {v}' for k, v in res['tokens'].items())}); {res['weights']}")
    print()
    print("Jensen-Shannon divergence (bits, 0 = same experts, 1 = disjoint) of expert usage, per layer")
    header = "  " + " " * 28 + "".join(f"  L{layer:<4d}" for layer in range(n_layers)) + "  mean"
    print(header)

    def row(label, values):
        print(f"  {label:<28s}" + "".join(f"  {v:.3f}" for v in values) + f"  {np.mean(values):.3f}")

    row("Italian vs English", js_it_en)
    for kind, v in same_kind.items():
        row(f"  {'man pages' if kind == 'man' else 'fortunes'} only", v)
    for lang, v in noise.items():
        row(f"noise: {NAMES[lang]} vs itself", v)
    for lang, v in kind_js.items():
        row(f"{NAMES[lang]}: man vs fortune", v)
    print()
    print("  every pair of languages (mean over layers; the kinds of a language weighted equally)")
    print("        " + "".join(f"{b:>7s}" for b in langs))
    for a in langs:
        cells = []
        for b in langs:
            if a == b:
                cells.append("      -")
            else:
                v = pairs.get(f"{a}-{b}") or pairs.get(f"{b}-{a}")
                cells.append(f"{np.mean(v):7.3f}")
        print(f"  {a:>4s}  " + "".join(cells))

    # --- hottest 25 %
    print()
    print("Share of expert activations carried by the hottest 25% of experts, per layer")
    print(header)
    hot = {}
    for lang in langs:
        hot[lang] = [hot_share(lang_usage[lang][layer]) for layer in range(n_layers)]
        row(NAMES[lang], hot[lang])
    mix = np.mean([lang_usage[lang] for lang in langs], axis=0)
    hot["mix"] = [hot_share(mix[layer]) for layer in range(n_layers)]
    row("all languages mixed", hot["mix"])
    print(f"  {'uniform routing':<28s}  0.250")
    q = qwen_reference()
    if q:
        print(f"  {'Qwen3-30B-A3B (48 layers)':<28s}  mean {q['hot25_mean']:.3f}, min {q['hot25_min']:.3f}, "
              f"max {q['hot25_max']:.3f} ({q['experts']} experts, top-{q['top_k']}; {HEAT.name})")
    res["hot25"] = hot
    res["hot25_qwen3_30b_a3b"] = q
    res["usage_entropy_bits"] = {lang: [float(-(p[p > 0] * np.log2(p[p > 0])).sum()) for p in lang_usage[lang]]
                                 for lang in langs}
    res["usage_entropy_bits"]["mix"] = [float(-(p[p > 0] * np.log2(p[p > 0])).sum()) for p in mix]
    print(f"  expert-usage entropy (bits, max {math.log2(n_exp):.0f}), mean over layers: "
          + ", ".join(f"{k} {np.mean(v):.2f}" for k, v in res["usage_entropy_bits"].items()))

    # --- perplexity
    with open(Path(args.heldout_dir) / "unigram_train_counts.json") as f:
        uni = np.asarray(json.load(f)["counts"], np.float64)
    logp_uni = np.log((uni + 1) / (uni.sum() + len(uni)))
    print()
    print("Held-out perplexity per token (the same tokens for both; unigram: training-split counts, add-one), "
          "and the model's nats per character (comparable across tokenizers)")
    print(f"  {'':<10s}{'tokens':>8s}{'model':>10s}{'unigram':>10s}{'nats/char':>11s}   per kind (model / unigram)")
    ppl = {}
    for lang in langs:
        keys = [k for k in nll if k.startswith(lang + ".")]
        l = np.concatenate([nll[k] for k in keys])
        t = np.concatenate([targets[k] for k in keys])
        m, u = math.exp(l.mean()), math.exp(-logp_uni[t].mean())
        per_char = l.sum() / sum(chars[k] for k in keys)
        kinds = {k.split(".")[1]: (math.exp(nll[k].mean()), math.exp(-logp_uni[targets[k]].mean())) for k in keys}
        ppl[lang] = {"tokens": int(len(t)), "model": m, "unigram": u, "nats_per_char": float(per_char),
                     "per_kind": {k: {"model": a, "unigram": b} for k, (a, b) in kinds.items()}}
        print(f"  {NAMES[lang]:<10s}{len(t):>8d}{m:>10.1f}{u:>10.1f}{per_char:>11.4f}   "
              + ", ".join(f"{k} {a:.1f} / {b:.1f}" for k, (a, b) in kinds.items()))
    res["perplexity"] = ppl
    res["seconds"] = round(time.time() - t0, 1)
    write_json(args.out, res)
    print(f"\nwrote {args.out} ({res['seconds']:.0f}s)")


if __name__ == "__main__":
    main()
