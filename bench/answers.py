"""A bench model that answers as a given sequence of tokens says (bench_speculative.py --answers).

Its layers compute as they would (their cost and their experts stay), but the logits at context
position q become one-hot on the sequence's token q + 1 (the KV cache's offset gives q), so that
greedy decoding, with drafts or without, gives the sequence's continuation of its prompt: a
verify step's later positions only count where the drafts before them matched, that is where
the context is the sequence's. On a checkpoint with random weights whose step of T tokens costs
about one (bench_host.py's host-bound one, as a GPU's), drafting then meets the acceptance that
real answers give it, not the loops of random weights. Two tasks:

- repeat: a held-out paragraph given twice, then its first tokens; the answer repeats the
  paragraph verbatim (what a model quoting a given text or editing code does, at best);
- chat: Qwen3.6-35B-A3B's greedy answers to one chat prompt, recorded by moe_ocs_learning with
  MLX and with vLLM (the real-routing data's moe-ocs-learning-qwen3.6/, thinking on; they differ
  after a few tokens), their token ids mapped one to one onto the model's vocabulary (n-gram
  matches kept as they were).
"""

import json
from pathlib import Path

CHAT_ANSWERS = ("moe-ocs-learning-qwen3.6/routing_pretrained.mlx.ece94543.json",
                "moe-ocs-learning-qwen3.6/routing_pretrained.vllm.7534a717.json")
FIRST_ID = 10  # mapped ids start here (the bench tokenizers' special tokens below it)
REPEAT_CUE = 8  # tokens of the paragraph that end the repeat prompt


def repeat_texts(n):
    """The repeat task's n held-out paragraphs (bench_speculative.py's too)."""
    from heldout import prompts

    return [p for p in prompts("en", 4 * n) if len(p) > 200][:n]


def sequences(tokenizer, task, n, real_routing, vocab):
    """[(prompt ids, the whole sequence's ids)] of `task`, n at most (chat: 2)."""
    if task == "repeat":
        ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        out = []
        for text in repeat_texts(n):
            t, sep = ids(text), ids("\n\n")
            prompt = t + sep + t + sep + t[:REPEAT_CUE]
            out.append((prompt, prompt + t[REPEAT_CUE:]))
        return out
    out = []
    for name in CHAT_ANSWERS[:n]:
        path = Path(real_routing) / name
        try:
            recorded = json.loads(path.read_text())
            prompt, answer = recorded["prompt_tokens"], recorded["generated_tokens"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"--answers: {path}: {e}") from None
        mapped = {}
        for t in prompt + answer:
            mapped.setdefault(t, FIRST_ID + len(mapped))
        if FIRST_ID + len(mapped) > vocab:
            raise SystemExit(f"--answers: {path} has {len(mapped)} distinct tokens, more than the model's "
                             f"vocabulary of {vocab} can take")
        out.append(([mapped[t] for t in prompt], [mapped[t] for t in prompt + answer]))
    return out


def answer_as(model, state):
    """Make `model` answer as state["sequence"] (a list of ids, set before each generation) says."""
    import mlx.core as mx

    cls = type(model)

    def call(self, inputs, *args, **kwargs):
        cache = kwargs.get("cache", args[0] if args else None)
        offset = cache[0].offset if cache else 0  # (before the call writes the cache)
        out = cls.__call__(self, inputs, *args, **kwargs)
        sequence = state["sequence"]
        at = mx.minimum(mx.arange(inputs.shape[-1]) + offset + 1, len(sequence) - 1)
        want = mx.array(sequence)[at]
        onehot = mx.where(mx.arange(out.shape[-1]) == want[:, None], 0.0, -100.0)
        return out * 0 + onehot.astype(out.dtype)

    model.__class__ = type(f"Answering{cls.__name__}", (cls,), {"__call__": call})
