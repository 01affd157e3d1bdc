"""Held-out text of the demo model's corpus (bench/data/heldout, never trained on), as
one-line prompts per language."""

import re
from pathlib import Path

from system import write_atomic

HELDOUT = Path(__file__).resolve().parent / "data" / "heldout"
LANGUAGES = ("it", "en", "de", "fr", "es")


def prompts(lang, n=None, max_chars=400):
    """Held-out text of `lang` cut into prompts of at most `max_chars` characters at word
    boundaries, whitespace collapsed, fortunes and man pages alternating."""
    kinds = []
    for kind in ("fortune", "man"):
        path = HELDOUT / f"{lang}.{kind}.txt"
        if path.exists():
            pieces = []
            for doc in path.read_text(encoding="utf-8").split("<|endoftext|>"):
                words, piece = re.sub(r"\s+", " ", doc).split(), ""
                for word in words:
                    if piece and len(piece) + 1 + len(word) > max_chars:
                        pieces.append(piece)
                        piece = ""
                    piece = f"{piece} {word}" if piece else word
                pieces.append(piece)
            kinds.append([p for p in pieces if len(p) >= 40])
    out = []
    for i in range(max(map(len, kinds))):
        out += [k[i] for k in kinds if i < len(k)]
    return out[:n] if n else out


def write_prompts(lang, path, n=None):
    write_atomic(path, ("\n".join(prompts(lang, n)) + "\n").encode("utf-8"))
    return path
