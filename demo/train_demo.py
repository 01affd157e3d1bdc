"""Train mlxmoe's bundled demo model: a small multilingual qwen3_moe, on this CPU.

    python demo/train_demo.py                    # corpus + tokenizer + training + 4-bit export
    python demo/train_demo.py --steps 20 --chat-steps 5 --work /tmp/demo-smoke-work --out /tmp/demo-smoke  # smoke
    python demo/train_demo.py --continue-from 0745f27 --steps 600   # more training on a committed demo model
    python demo/train_demo.py --continue-from 73e2b16 --steps 600 --warmup 20 --lr 2e-4 --sampling-power 0.5 \
        --chat-steps 60 --chat-lr 1e-4                              # the shipped model's last run (an anneal)

What it does, reproducibly (fixed seed, sorted file lists, fixed step count):

1. Installs the corpus's Debian packages (apt-get) when they are missing: the Linux
   man-pages in English and their Italian, French, German and Spanish translations, and
   the fortune cookies in English, Italian, German and Spanish.
2. Renders every man page to plain text with mandoc (overstrikes stripped), splits the
   fortune files into fortunes, and holds out ~5 % of the documents of every language
   (by page name, so a held-out page is held out in every language; by fortune) that
   are never trained on. Languages are capped to similar sizes; the sampler then draws
   every language equally often (upsampling the smaller ones).
3. Trains a byte-level BPE tokenizer (ChatML specials and chat template) on the training
   split, and mlx-lm's own `qwen3_moe` Model with a Switch-Transformer load-balancing
   loss on every router, so that the expert skew that remains is the workload's; then
   tunes it for chat (a fresh optimizer, half the rows greeting conversations of mixed
   languages: CHAT_TUNE). `--from-phase1` starts from the first phase's weights that an
   earlier run left in the work folder. `--continue-from REV` starts instead from the
   demo model committed at git revision REV (its 4-bit weights dequantized, its tokenizer
   kept) and trains both phases again on top of it (CONTINUE: a lower peak rate; `--lr`
   and `--chat-lr` set the phases' peak rates, `--sampling-power` draws the larger
   languages more often).
4. Quantizes to 4 bits with mlx-lm's `quantize_model` and saves with mlx-lm's
   `save_model`/`save_config` into `mlxmoe/demo/` with `training.json` (sources,
   package versions, seed, sizes, hyperparameters, time, losses), plus small held-out
   samples and the training split's unigram counts in `bench/data/heldout/` for
   `bench/demo_routing.py`.

The corpus itself lives in the work folder (default ~/.cache/mlxmoe-demo), not the repo.
"""

import argparse
import glob
import gzip
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO / "mlxmoe" / "demo"
HELDOUT_DIR = REPO / "bench" / "data" / "heldout"
DEFAULT_WORK = Path(os.environ.get("MLXMOE_DEMO_WORK", Path.home() / ".cache" / "mlxmoe-demo"))

SEED = 1234
LANGS = ("en", "it", "fr", "de", "es")
KINDS = ("man", "fortune")

MAN_PACKAGES = {"en": "manpages", "it": "manpages-it", "fr": "manpages-fr", "de": "manpages-de",
                "es": "manpages-es"}
FORTUNE_PACKAGES = {"en": "fortunes", "it": "fortunes-it", "de": "fortunes-de", "es": "fortunes-es"}
TOOL_PACKAGES = ["mandoc"]
BLAS_PACKAGE = "libopenblas0-pthread"

# Fortune files that are pictures, not text, and the "offensive" collections.
FORTUNE_SKIP = {"art", "ascii-art", "asciiart", "banner"}

# Corpus caps, in characters of the training split per language and kind. Italian has
# the fewest man pages (~180) so it sets the scale; the sampler upsamples the rest.
MAN_CAP = 2_600_000
FORTUNE_CAP = 1_200_000
PAGE_CAP = 16_000        # characters kept of one man page (bash(1) alone is 300k)
HELDOUT_PERCENT = 5

# Special tokens get the first ids; <|im_end|> ends a chat turn, <|endoftext|> a document.
# The same tokens and ChatML template as the test checkpoints (synthetic.py, at the repository's root).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from synthetic import CHAT_TEMPLATE, SPECIAL_TOKENS  # noqa: E402

EOT, IM_START, IM_END = SPECIAL_TOKENS

# Chat-formatted samples: a third of the fortunes answer a request for one, and every
# man page's description answers "what is NAME?", in the page's language.
FORTUNE_REQUESTS = {
    "en": ["Tell me a fortune.", "Say something wise.", "Tell me a joke.", "Give me a quote."],
    "it": ["Dimmi una frase.", "Dimmi qualcosa di saggio.", "Raccontami una barzelletta.", "Dammi una citazione."],
    "de": ["Sag mir einen Spruch.", "Sag etwas Weises.", "Erzähl mir einen Witz.", "Gib mir ein Zitat."],
    "es": ["Dime una frase.", "Dime algo sabio.", "Cuéntame un chiste.", "Dame una cita."],
    "fr": ["Dis-moi une phrase.", "Dis quelque chose de sage.", "Raconte-moi une blague.", "Donne-moi une citation."],
}
MAN_QUESTIONS = {
    "en": ["What is {}?", "What does {} do?"],
    "it": ["Che cos'è {}?", "Cosa fa {}?"],
    "fr": ["Qu'est-ce que {} ?", "Que fait {} ?"],
    "de": ["Was ist {}?", "Was macht {}?"],
    "es": ["¿Qué es {}?", "¿Qué hace {}?"],
}
SAMPLE_PROMPTS = {
    "en": "The file system is",
    "it": "Il file di configurazione",
    "fr": "Le fichier de configuration",
    "de": "Die Datei",
    "es": "El archivo de configuración",
}
DESCRIPTION_HEADERS = {"DESCRIPTION", "DESCRIZIONE", "BESCHREIBUNG", "DESCRIPCIÓN"}
# Sections that list the translators (real names and e-mail addresses): dropped.
TRANSLATION_HEADERS = {"TRANSLATION", "TRADUZIONE", "TRADUCTION", "ÜBERSETZUNG", "TRADUCCIÓN"}
CHAT_FORTUNE_SHARE = 3  # one fortune in three is chat-formatted

# E-mail addresses and URLs are removed from every document, with the brackets around
# them, so the model cannot reproduce a real person's address.
EMAIL = r"(?:mailto:)?[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{2,}"
URL = r"(?:(?:https?|ftp|file|git)://|www\.)[^\s<>()\[\]\"']*[^\s<>()\[\]\"'.,;:!?]"
SCRUB = re.compile(rf"[<(\[]\s*(?:{EMAIL}|{URL})\s*[>)\]]|{EMAIL}|{URL}")

# Chat-shaped samples: short exchanges in each language (a greeting, then maybe a question),
# each assistant turn short and ended by <|im_end|>, so that chat gets an answer in the
# user's language that stops. Pairs of (user variants, assistant variants).
GREETINGS = {
    "en": [
        (["hello", "hi", "hey", "hello there", "hi there", "greetings"],
         ["Hello! How can I help you?", "Hi! What can I do for you?", "Hello! What would you like to know?"]),
        (["good morning", "good afternoon", "good evening"],
         ["Hello! How can I help you today?", "Hello! What can I do for you today?"]),
    ],
    "it": [
        (["ciao", "salve", "ehi", "ciao a tutti"],
         ["Ciao! Come posso aiutarti?", "Ciao! Cosa posso fare per te?", "Salve! Cosa vuoi sapere?"]),
        (["buongiorno", "buonasera", "buon pomeriggio"],
         ["Salve! Come posso aiutarti?", "Salve! Cosa posso fare per te oggi?"]),
    ],
    "fr": [
        (["bonjour", "salut", "coucou", "bonjour à tous"],
         ["Bonjour ! Comment puis-je vous aider ?", "Salut ! Que puis-je faire pour toi ?",
          "Bonjour ! Que voulez-vous savoir ?"]),
        (["bonsoir", "bon après-midi"],
         ["Bonjour ! Comment puis-je vous aider ?", "Bonjour ! Que puis-je faire pour vous ?"]),
    ],
    "de": [
        (["hallo", "servus", "moin", "hallo zusammen"],
         ["Hallo! Wie kann ich helfen?", "Hallo! Was kann ich für dich tun?", "Hallo! Was möchtest du wissen?"]),
        (["guten Morgen", "guten Tag", "guten Abend"],
         ["Hallo! Wie kann ich Ihnen helfen?", "Hallo! Was kann ich heute für Sie tun?"]),
    ],
    "es": [
        (["hola", "buenas", "hola a todos", "qué tal"],
         ["¡Hola! ¿En qué puedo ayudarte?", "¡Hola! ¿Qué puedo hacer por ti?", "¡Hola! ¿Qué quieres saber?"]),
        (["buenos días", "buenas tardes", "buenas noches"],
         ["¡Hola! ¿En qué puedo ayudarle?", "¡Hola! ¿Qué puedo hacer por usted hoy?"]),
    ],
}
SMALL_TALK = {
    "en": [
        (["How are you?", "how are you doing?"], ["I am fine, thank you. And you?", "Very well, thanks!"]),
        (["Who are you?", "What are you?"],
         ["I am a small demo model, trained on manual pages and fortunes.", "A small language model: ask me about a command."]),
        (["What can you do?", "Can you help me?"],
         ["I can tell you what a command does, or tell you a fortune.", "Yes: ask me about a command or a file."]),
        (["thanks", "thank you"], ["You are welcome!", "My pleasure."]),
        (["bye", "goodbye", "see you"], ["Goodbye!", "Bye! See you soon."]),
    ],
    "it": [
        (["Come stai?", "come va?"], ["Sto bene, grazie. E tu?", "Molto bene, grazie!"]),
        (["Chi sei?", "Cosa sei?"],
         ["Sono un piccolo modello dimostrativo, addestrato su pagine di manuale e frasi celebri.",
          "Un piccolo modello linguistico: chiedimi di un comando."]),
        (["Cosa sai fare?", "Puoi aiutarmi?"],
         ["Posso dirti cosa fa un comando, o dirti una frase.", "Sì: chiedimi di un comando o di un file."]),
        (["grazie", "grazie mille"], ["Prego!", "Di niente."]),
        (["arrivederci", "ciao ciao", "a presto"], ["Arrivederci!", "Ciao, a presto!"]),
    ],
    "fr": [
        (["Comment ça va ?", "Comment allez-vous ?"], ["Je vais bien, merci. Et vous ?", "Très bien, merci !"]),
        (["Qui es-tu ?", "Qu'est-ce que tu es ?"],
         ["Je suis un petit modèle de démonstration, entraîné sur des pages de manuel.",
          "Un petit modèle de langue : demandez-moi ce que fait une commande."]),
        (["Que sais-tu faire ?", "Peux-tu m'aider ?"],
         ["Je peux expliquer ce que fait une commande.", "Oui : demandez-moi une commande ou un fichier."]),
        (["merci", "merci beaucoup"], ["De rien !", "Avec plaisir."]),
        (["au revoir", "à bientôt"], ["Au revoir !", "À bientôt !"]),
    ],
    "de": [
        (["Wie geht es dir?", "wie geht's?"], ["Mir geht es gut, danke. Und dir?", "Sehr gut, danke!"]),
        (["Wer bist du?", "Was bist du?"],
         ["Ich bin ein kleines Demo-Modell, trainiert auf Handbuchseiten und Sprüchen.",
          "Ein kleines Sprachmodell: frag mich nach einem Befehl."]),
        (["Was kannst du?", "Kannst du mir helfen?"],
         ["Ich kann dir sagen, was ein Befehl macht, oder einen Spruch erzählen.",
          "Ja: frag mich nach einem Befehl oder einer Datei."]),
        (["danke", "vielen Dank"], ["Gern geschehen!", "Bitte sehr."]),
        (["tschüss", "auf Wiedersehen", "bis bald"], ["Auf Wiedersehen!", "Tschüss, bis bald!"]),
    ],
    "es": [
        (["¿Cómo estás?", "¿qué tal estás?"], ["Estoy bien, gracias. ¿Y tú?", "¡Muy bien, gracias!"]),
        (["¿Quién eres?", "¿Qué eres?"],
         ["Soy un pequeño modelo de demostración, entrenado con páginas de manual y frases.",
          "Un pequeño modelo de lenguaje: pregúntame por un comando."]),
        (["¿Qué sabes hacer?", "¿Puedes ayudarme?"],
         ["Puedo decirte qué hace un comando, o decirte una frase.", "Sí: pregúntame por un comando o un archivo."]),
        (["gracias", "muchas gracias"], ["¡De nada!", "Con mucho gusto."]),
        (["adiós", "hasta luego", "hasta pronto"], ["¡Adiós!", "¡Hasta pronto!"]),
    ],
}
GREETING_CHATS = 1200  # conversations per language (5-10 % of the stream they go with)

# Model: mlx-lm's qwen3_moe. See README / training.json for why these sizes.
MODEL_CONFIG = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,        # unused: every layer is MoE
    "moe_intermediate_size": 128,
    "num_experts": 32,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
TRAIN = {
    "vocab_size": 4096,
    "seq_len": 256,
    "batch_size": 8,
    "steps": 800,
    "lr": 2e-3,
    "min_lr_ratio": 0.1,
    "warmup": 100,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "aux_loss_coef": 0.01,   # per MoE layer (the losses of the layers are summed)
    "quant_bits": 4,
    "quant_group_size": 64,  # divides 256 (hidden) and 128 (moe_intermediate): every matrix quantizes
}
# Phase 2: a fresh AdamW at a lower rate; half the rows are greeting conversations of random
# languages back to back (phase 1 saw each one amid text of its own language, and learnt
# to answer in that text's language, not in the user's).
CHAT_TUNE = {"steps": 300, "lr": 5e-4, "min_lr_ratio": 0.1, "warmup": 20, "chat_share": 0.5, "chats": 1200}
# --continue-from: phase 1 restarts on a model that has already been through both phases,
# at half the peak rate with a short warmup (its tokenizer and corpus are the same).
CONTINUE = {"lr": 1e-3, "warmup": 50}


# --------------------------------------------------------------------------- setup


def _log(*args):
    print(f"[train_demo {time.strftime('%H:%M:%S')}]", *args, flush=True)


def _installed(pkg):
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
    return r.returncode == 0 and "install ok installed" in r.stdout


def package_version(pkg):
    r = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def apt_install(packages):
    """apt-get install the missing ones; False when that is impossible (not Debian, no root)."""
    missing = [p for p in packages if shutil.which("dpkg-query") and not _installed(p)]
    if not shutil.which("dpkg-query"):
        return False
    if not missing:
        return True
    if not shutil.which("apt-get"):
        return False
    _log("apt-get install", " ".join(missing))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    r = subprocess.run(["apt-get", "install", "-y", "-q"] + missing, env=env, capture_output=True, text=True)
    if r.returncode != 0:  # the package lists may be missing on a fresh machine
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        r = subprocess.run(["apt-get", "install", "-y", "-q"] + missing, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        _log("apt-get failed:", r.stderr.strip()[-400:])
    return all(_installed(p) for p in packages)


def corpus_packages():
    return sorted(set(MAN_PACKAGES.values()) | set(FORTUNE_PACKAGES.values()) | set(TOOL_PACKAGES))


def ensure_fast_blas(install=True):
    """Re-exec this script with Debian's OpenBLAS preloaded, when there is one.

    MLX's Linux CPU wheel links a slow reference BLAS: a [2048,256]@[256,4096] float32
    matmul runs at ~5 GFLOP/s on the development machine, ~33 GFLOP/s with OpenBLAS
    preloaded, and a training step of this model takes 9.7 s instead of 1.3 s. OpenBLAS
    exports the same cblas_* symbols, so LD_PRELOAD makes MLX call it; nothing else
    changes. Without the library (no apt, not Debian, macOS: Accelerate) we go on as is.
    """
    if sys.platform != "linux" or "MLXMOE_DEMO_BLAS" in os.environ:
        return
    pattern = "/usr/lib/*/openblas-pthread/libopenblas.so.0"
    found = sorted(glob.glob(pattern))
    if not found and install and apt_install([BLAS_PACKAGE]):
        found = sorted(glob.glob(pattern))
    env = dict(os.environ, MLXMOE_DEMO_BLAS=found[0] if found else "none")
    if not found:
        _log("OpenBLAS not available: MLX's reference BLAS is ~7x slower")
        os.environ.update(env)
        return
    env["LD_PRELOAD"] = ":".join(p for p in (found[0], os.environ.get("LD_PRELOAD")) if p)
    _log("re-executing with LD_PRELOAD", found[0])
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


# --------------------------------------------------------------------------- corpus


def _read_text(path):
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _package_files(pkg):
    r = subprocess.run(["dpkg", "-L", pkg], capture_output=True, text=True, check=True)
    return sorted(set(r.stdout.split("\n")) - {""})


def _held_out(key):
    return int(hashlib.md5(key.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def render_man(path):
    """A man page as plain text: mandoc, overstrikes and the header/footer lines removed,
    paragraphs on one line (width 1000), indentation and runs of blanks collapsed.
    Returns (text, description's first paragraph, page name) or None."""
    r = subprocess.run(["mandoc", "-Tutf8", "-O", "width=1000", str(path)], capture_output=True)
    if r.returncode >= 4 or not r.stdout:  # 1-3: warnings, errors, unsupported: the page still renders
        return None
    text = re.sub(r".\x08", "", r.stdout.decode("utf-8", "replace"))
    lines = [ln.rstrip() for ln in text.split("\n")]
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    if len(lines) < 4:
        return None
    lines = lines[1:-1]  # "LS(1)   User Commands   LS(1)" and the footer
    description, section = None, None
    out = []
    for ln in map(scrub, lines):
        header = bool(ln) and not ln[0].isspace()
        if header:
            section = ln.strip()
        if section in TRANSLATION_HEADERS:
            continue
        if not header and section in DESCRIPTION_HEADERS and description is None and ln.strip():
            description = re.sub(r"\s+", " ", ln.strip())
        out.append(re.sub(r"[ \t]+", " ", ln.strip()))
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()
    if len(text) > PAGE_CAP:
        cut = text.rfind("\n\n", 0, PAGE_CAP)
        text = text[: cut if cut > PAGE_CAP // 2 else PAGE_CAP]
    if len(text) < 200:
        return None
    return text, description, None


def _man_key(path):
    """'man1/ls.1' for /usr/share/man/it/man1/ls.1.gz: the page, whatever the language."""
    p = Path(path)
    name = p.name[:-3] if p.name.endswith(".gz") else p.name
    return f"{p.parent.name}/{name}"


def _man_files(lang, translated_keys=None):
    """Real files (no symlinks, no .so stubs) of a language's man pages, sorted.

    English is the `manpages` package (sections 2-7) plus the English originals of the
    translated pages that are installed (mostly section 1 and 8), so that much of it is
    parallel to the other languages."""
    files = [f for f in _package_files(MAN_PACKAGES[lang]) if re.search(r"/man\d/[^/]+\.gz$", f)]
    if lang == "en":
        for key in translated_keys or ():
            f = f"/usr/share/man/{key}.gz"
            if os.path.exists(f):
                files.append(f)
    seen, out = set(), []
    for f in sorted(set(files)):
        if os.path.islink(f) or not os.path.isfile(f):
            continue
        real = os.path.realpath(f)
        if real in seen:
            continue
        seen.add(real)
        with gzip.open(f, "rb") as fh:
            head = fh.read(200)
        if head.lstrip().startswith(b".so "):
            continue
        out.append(f)
    return out


def _fortune_files(lang):
    files = []
    for f in _package_files(FORTUNE_PACKAGES[lang]):
        p = Path(f)
        if (not f.startswith("/usr/share/games/fortunes/") or p.suffix in (".dat", ".u8") or "/off/" in f
                or os.path.islink(f) or not p.is_file() or p.name.split(".")[0] in FORTUNE_SKIP):
            continue
        files.append(f)
    return sorted(files)


def _split_fortunes(path):
    text = re.sub(r".\x08", "", _read_text(path)).replace("\r", "")
    out = []
    for chunk in re.split(r"\n%\n", "\n" + text + "\n"):
        chunk = "\n".join(scrub(ln).rstrip() for ln in chunk.strip("\n").split("\n")).strip()
        if 10 <= len(chunk) <= 2000:
            out.append(chunk)
    return out


def scrub(text):
    """`text` without e-mail addresses and URLs (and the brackets around them)."""
    text = SCRUB.sub("", text)
    text = re.sub(r"[ \t]+([,.;:)])", r"\1", text)
    return re.sub(r"[ \t]{2,}", " ", text)


def _chat(question, answer):
    return f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n"


def _user_variant(text, rng):
    """A user's spelling of `text`: as written, capitalized, lower case; with or without '!'/'.'."""
    text = rng.choice([text, text, text[:1].upper() + text[1:], text.lower()])
    if text[-1].isalpha():
        text += rng.choice(["", "", "!", "."])
    return text


def greeting_chats(lang, n, rng):
    """`n` short conversations in `lang`: a greeting and its answer, then up to two
    small-talk turns (thanks and goodbye last), every turn ended by <|im_end|>."""
    out = []
    talk = SMALL_TALK[lang]
    for _ in range(n):
        picked = sorted(rng.sample(range(len(talk)), rng.choice([0, 0, 1, 2])))
        turns = [rng.choice(GREETINGS[lang])] + [talk[i] for i in picked]
        if rng.randrange(4) == 0:  # some conversations open with a question
            turns = turns[1:] or turns
        out.append("".join(_chat(_user_variant(rng.choice(q), rng), rng.choice(a)) for q, a in turns) + EOT)
    return out


def build_corpus(work=DEFAULT_WORK, rebuild=False):
    """{lang: {kind: {"train": [doc strings], "heldout": [plain texts]}}} and its manifest.

    Training documents are strings in the model's own format: plain text followed by
    <|endoftext|>, or a ChatML exchange. Held-out documents are plain text. Cached in
    `work/corpus.json`."""
    work = Path(work)
    cache = work / "corpus.json"
    if cache.exists() and not rebuild:
        with open(cache) as f:
            data = json.load(f)
        return data["corpus"], data["manifest"]
    if not apt_install(corpus_packages()) or not shutil.which("mandoc"):
        raise SystemExit("the corpus needs Debian packages (apt-get install " + " ".join(corpus_packages()) + ")")
    t0 = time.time()
    rng = random.Random(SEED)
    corpus = {lang: {kind: {"train": [], "heldout": []} for kind in KINDS} for lang in LANGS}
    sizes = {lang: {} for lang in LANGS}

    translated = sorted({_man_key(f) for lang in LANGS if lang != "en" for f in _man_files(lang)})
    for lang in LANGS:
        files = _man_files(lang, translated)
        rng.shuffle(files)
        chars, used = 0, 0
        for f in files:
            held = _held_out(_man_key(f))
            if not held and chars >= MAN_CAP:
                continue
            page = render_man(f)
            if page is None:
                continue
            text, description, _ = page
            if held:
                corpus[lang]["man"]["heldout"].append(text)
                continue
            used += 1
            chars += len(text)
            corpus[lang]["man"]["train"].append(text + EOT)
            name = Path(_man_key(f)).name.rsplit(".", 1)[0]
            if description and len(description) > 40:
                q = rng.choice(MAN_QUESTIONS[lang]).format(name)
                corpus[lang]["man"]["train"].append(_chat(q, description[:800]) + EOT)
        sizes[lang]["man_files"] = len(files)
        sizes[lang]["man_pages_trained"] = used
        _log(f"{lang} man: {used} pages, {chars} chars, {len(corpus[lang]['man']['heldout'])} held out")

        if lang in FORTUNE_PACKAGES:
            fortunes = []
            for f in _fortune_files(lang):
                fortunes += [(f"{Path(f).name}:{i}", t) for i, t in enumerate(_split_fortunes(f))]
            rng.shuffle(fortunes)
            chars = 0
            for key, text in fortunes:
                if _held_out(key):
                    corpus[lang]["fortune"]["heldout"].append(text)
                elif chars < FORTUNE_CAP:
                    chars += len(text)
                    if rng.randrange(CHAT_FORTUNE_SHARE) == 0:
                        corpus[lang]["fortune"]["train"].append(_chat(rng.choice(FORTUNE_REQUESTS[lang]), text) + EOT)
                    else:
                        corpus[lang]["fortune"]["train"].append(text + EOT)
            sizes[lang]["fortunes_available"] = len(fortunes)
            _log(f"{lang} fortunes: {chars} chars, {len(corpus[lang]['fortune']['heldout'])} held out")
        # The greetings go with the fortunes (the shorter stream) where a language has them.
        kind = "fortune" if corpus[lang]["fortune"]["train"] else "man"
        corpus[lang][kind]["train"] += greeting_chats(lang, GREETING_CHATS, rng)
        sizes[lang]["greeting_chats"] = GREETING_CHATS
        for kind in KINDS:
            for split in ("train", "heldout"):
                docs = corpus[lang][kind][split]
                sizes[lang][f"{kind}_{split}_docs"] = len(docs)
                sizes[lang][f"{kind}_{split}_chars"] = sum(map(len, docs))
    manifest = {
        "sources": {
            "packages": {p: package_version(p) for p in corpus_packages()},
            "man": "every page of manpages-{it,fr,de,es}; English: the `manpages` package plus the installed "
                   "English originals of the translated pages; rendered with `mandoc -Tutf8 -O width=1000`, "
                   "overstrikes stripped, header/footer dropped, at most %d chars per page" % PAGE_CAP,
            "fortune": "fortunes, fortunes-it, fortunes-de, fortunes-es (no 'off' collections, no ascii art)",
            "heldout": f"{HELDOUT_PERCENT}% of documents by md5 of the page name (same pages in every language) "
                       "or of file:index for fortunes",
            "caps_chars": {"man": MAN_CAP, "fortune": FORTUNE_CAP},
            "chat_samples": "one fortune in %d as 'user: <request> / assistant: <fortune>', every man page's "
                            "first DESCRIPTION paragraph as the answer to 'what is NAME?', in the page's "
                            "language, and %d short greeting/small-talk conversations per language (with the "
                            "fortunes, or the man pages where a language has no fortunes)"
                            % (CHAT_FORTUNE_SHARE, GREETING_CHATS),
            "scrubbed": "e-mail addresses and URLs removed from every document (with their brackets); the "
                        "translators' sections of the man pages dropped",
        },
        "seed": SEED,
        "sizes": sizes,
        "build_seconds": round(time.time() - t0, 1),
    }
    work.mkdir(parents=True, exist_ok=True)
    with open(cache, "w") as f:
        json.dump({"corpus": corpus, "manifest": manifest}, f)
    _log(f"corpus built in {time.time() - t0:.0f}s -> {cache}")
    return corpus, manifest


# --------------------------------------------------------------------------- tokenizer


def _content(doc):
    """Training text for the tokenizer: a document without its special tokens."""
    for s in SPECIAL_TOKENS:
        doc = doc.replace(s, "\n")
    return doc


def train_tokenizer(corpus, out_dir, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [_content(d) for lang in LANGS for kind in KINDS for d in corpus[lang][kind]["train"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=EOT,
                                   chat_template=CHAT_TEMPLATE)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return tok


def encode_docs(tok, docs):
    """Token ids of documents (the special tokens in them are matched as such)."""
    import numpy as np

    out = tok.encode_batch(docs) if docs else []
    return np.array([i for e in out for i in e.ids], dtype=np.int32)


# --------------------------------------------------------------------------- routing hooks


@contextmanager
def record_gates(model):
    """Record every MoE router's logits while inside: yields the list they go to.

    The gate modules' class is swapped for a subclass that appends its output, so the
    parameter tree (and the saved checkpoint) is untouched; works for nn.Linear and
    nn.QuantizedLinear gates alike."""
    record = []
    swapped = []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue
        base = type(gate)
        sub = type(f"Recording{base.__name__}", (base,),
                   {"__call__": lambda self, x, _b=base: record.append(_b.__call__(self, x)) or record[-1]})
        gate.__class__ = sub
        swapped.append((gate, base))
    try:
        yield record
    finally:
        for gate, base in swapped:
            gate.__class__ = base


def routing_aux(record, top_k):
    """(Switch-Transformer load-balancing loss summed over layers, [layers, experts] top-k counts).

    Per layer: num_experts * sum_e f_e * P_e, with f_e the share of the top-k assignments
    that go to expert e and P_e its mean router probability; 1.0 when balanced."""
    import mlx.core as mx

    aux, counts = 0.0, []
    for logits in record:
        n_exp = logits.shape[-1]
        p = mx.softmax(logits.reshape(-1, n_exp).astype(mx.float32), axis=-1)
        kth = mx.stop_gradient(mx.sort(p, axis=-1)[:, -top_k])
        mask = mx.stop_gradient((p >= kth[:, None]).astype(mx.float32))
        f = mask.mean(axis=0) / top_k          # share of the routed assignments per expert
        aux = aux + n_exp * (f * p.mean(axis=0)).sum()
        counts.append(mask.sum(axis=0))
    return aux, mx.stack(counts)


def entropy_bits(counts):
    import numpy as np

    p = np.asarray(counts, dtype=np.float64)
    p = p / p.sum()
    return float(-(p[p > 0] * np.log2(p[p > 0])).sum())


def evaluate(model, ids_by_lang, seq_len, top_k, max_tokens=30_000, batch=8):
    """Per language: mean next-token loss (nats) and [layers, experts] routing counts."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    out = {}
    for lang, ids in ids_by_lang.items():
        ids = np.asarray(ids[:max_tokens + 1])
        n = (len(ids) - 1) // seq_len
        if n == 0:
            continue
        x = ids[: n * seq_len].reshape(n, seq_len)
        y = ids[1: n * seq_len + 1].reshape(n, seq_len)
        total, count, counts = 0.0, 0, None
        for i in range(0, n, batch):
            with record_gates(model) as rec:
                logits = model(mx.array(x[i:i + batch]))
                loss = nn.losses.cross_entropy(logits, mx.array(y[i:i + batch]), reduction="sum")
                _, c = routing_aux(rec, top_k)
            mx.eval(loss, c)
            total += loss.item()
            count += y[i:i + batch].size
            counts = np.array(c) if counts is None else counts + np.array(c)
        out[lang] = {"loss": total / count, "tokens": count, "counts": counts}
    return out


# --------------------------------------------------------------------------- training


def lr_at(step, cfg):
    if step < cfg["warmup"]:
        return cfg["lr"] * (step + 1) / cfg["warmup"]
    t = (step - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"])
    lo = cfg["lr"] * cfg["min_lr_ratio"]
    return lo + 0.5 * (cfg["lr"] - lo) * (1 + math.cos(math.pi * min(t, 1.0)))


def train(args):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models.qwen3_moe import Model, ModelArgs

    cfg = dict(TRAIN)
    tune = dict(CHAT_TUNE, steps=CHAT_TUNE["steps"] if args.chat_steps is None else args.chat_steps)
    tune["warmup"] = min(tune["warmup"], max(1, tune["steps"] // 10))
    if args.steps is not None:
        cfg["steps"] = args.steps
        cfg["warmup"] = min(cfg["warmup"], max(1, args.steps // 10))
    if args.continue_from:
        cfg.update(CONTINUE)
        cfg["warmup"] = min(cfg["warmup"], max(1, cfg["steps"] // 10))
    if args.warmup is not None:
        cfg["warmup"] = args.warmup
    if args.lr is not None:
        cfg["lr"] = args.lr
    if args.chat_lr is not None:
        tune["lr"] = args.chat_lr
    if args.sampling_power:
        cfg["sampling_power"] = args.sampling_power
    work = Path(args.work)
    out = Path(args.out)
    t_start = time.time()

    corpus, manifest = build_corpus(work, rebuild=args.rebuild_corpus)
    tok_dir = work / "tokenizer"
    base = None
    if args.continue_from:  # the earlier model's own tokenizer and weights
        base = checkout_demo(args.continue_from, work / f"from-{args.continue_from}")
        tok_dir = base / "tokenizer"
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    else:
        tok = train_tokenizer(corpus, tok_dir, cfg["vocab_size"])
    vocab = tok.get_vocab_size()
    _log(f"tokenizer: {vocab} tokens")

    rng = np.random.default_rng(SEED)
    train_ids, heldout_ids = {}, {}   # (lang, kind) -> token ids
    for lang in LANGS:
        for kind in KINDS:
            docs = corpus[lang][kind]["train"]
            held = [d + EOT for d in corpus[lang][kind]["heldout"]]
            if not docs:
                continue
            train_ids[lang, kind] = encode_docs(tok, [docs[i] for i in rng.permutation(len(docs))])
            heldout_ids[f"{lang}.{kind}"] = encode_docs(tok, held)
            sz = manifest["sizes"][lang]
            sz[f"{kind}_train_tokens"] = int(len(train_ids[lang, kind]))
            sz[f"{kind}_heldout_tokens"] = int(len(heldout_ids[f"{lang}.{kind}"]))
            _log(f"{lang} {kind}: {len(train_ids[lang, kind])} training tokens, "
                 f"{len(heldout_ids[f'{lang}.{kind}'])} held out")

    config = dict(MODEL_CONFIG, vocab_size=vocab, eos_token_id=[tok.token_to_id(IM_END), tok.token_to_id(EOT)])
    mx.random.seed(SEED)
    model = Model(ModelArgs.from_dict(config))
    earlier = None
    if base is not None:
        from mlx_lm import load as mlx_lm_load
        from mlx_lm.utils import dequantize_model

        shipped, _ = mlx_lm_load(str(base / "model"))
        weights = tree_flatten(dequantize_model(shipped).parameters())
        model.load_weights([(k, v.astype(mx.float32)) for k, v in weights])
        del shipped
        with open(base / "model" / "training.json") as f:
            earlier = json.load(f)
        _log(f"continuing from the demo model of {args.continue_from} "
             f"({earlier['tokens_seen']} tokens seen: {earlier['command']})")
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    top_k = config["num_experts_per_tok"]
    _log(f"model: {n_params / 1e6:.2f}M parameters")

    def loss_fn(model, x, y):
        with record_gates(model) as rec:
            logits = model(x)
        ce = nn.losses.cross_entropy(logits, y, reduction="mean")
        aux, counts = routing_aux(rec, top_k)
        return ce + cfg["aux_loss_coef"] * aux, ce, aux / len(counts), counts  # logged: the mean per layer

    value_and_grad = nn.value_and_grad(model, loss_fn)
    L, B = cfg["seq_len"], cfg["batch_size"]

    # --sampling-power P: a row's language drawn in proportion to its training tokens ** P
    # (0: uniform, the smaller languages upsampled; 1: by size)
    lang_p = None
    if args.sampling_power:
        size = np.array([sum(len(train_ids[k]) for k in train_ids if k[0] == lang) for lang in LANGS], float)
        lang_p = size ** args.sampling_power / (size ** args.sampling_power).sum()
        _log("languages drawn " + ", ".join(f"{lang} {p:.3f}" for lang, p in zip(LANGS, lang_p)))

    def text_row(rng):
        # A row's language is uniform (or see lang_p), then man page or fortune equally
        # often where a language has both: the smaller languages and kinds are upsampled.
        lang = LANGS[int(rng.integers(len(LANGS)))] if lang_p is None else rng.choice(LANGS, p=lang_p)
        return text_window(lang, rng)

    def text_window(lang, rng):
        kinds = [k for k in KINDS if (lang, k) in train_ids]
        ids = train_ids[lang, kinds[int(rng.integers(len(kinds)))]]
        i = int(rng.integers(0, len(ids) - L - 1))
        return ids[i:i + L + 1]

    def text_batch(rng):
        return np.stack([text_window(lang, rng) for lang in rng.choice(LANGS, size=B, p=lang_p)])

    def chat_batch(rng):
        return np.stack([chat_row(rng) if rng.random() < tune["chat_share"] else text_row(rng)
                         for _ in range(B)])

    def chat_row(rng):
        # Conversations of random languages back to back from the row's start, so that the
        # only hint of a reply's language is its own conversation.
        ids = []
        while len(ids) < L + 1:
            ids.extend(chat_ids[int(rng.integers(len(chat_ids)))])
        return np.array(ids[:L + 1], dtype=np.int32)

    def run(steps, lr, draw, rng, phase):
        """`steps` AdamW steps (a fresh optimizer) on batches `draw(rng)` of B rows of L + 1 tokens."""
        optimizer = optim.AdamW(learning_rate=lr["lr"], weight_decay=cfg["weight_decay"])
        history, counts_acc, ce_avg, aux_avg = [], None, None, None
        t0 = time.time()
        for step in range(steps):
            optimizer.learning_rate = lr_at(step, dict(lr, steps=steps))
            rows = draw(rng)
            x, y = mx.array(rows[:, :-1]), mx.array(rows[:, 1:])
            (loss, ce, aux, counts), grads = value_and_grad(model, x, y)
            grads, _ = optim.clip_grad_norm(grads, cfg["grad_clip"])
            optimizer.update(model, grads)
            mx.eval(model.parameters(), optimizer.state, ce, aux, counts)
            ce_v, aux_v = ce.item(), aux.item()
            ce_avg = ce_v if ce_avg is None else 0.98 * ce_avg + 0.02 * ce_v
            aux_avg = aux_v if aux_avg is None else 0.98 * aux_avg + 0.02 * aux_v
            c = np.array(counts)
            counts_acc = c if counts_acc is None else counts_acc + c
            if (step + 1) % args.log_every == 0 or step + 1 == steps:
                el = time.time() - t0
                ent = [round(entropy_bits(row), 2) for row in counts_acc]
                history.append({"phase": phase, "step": step + 1, "ce": round(ce_avg, 4), "aux": round(aux_avg, 4),
                                "lr": optimizer.learning_rate.item(), "seconds": round(el, 1),
                                "usage_entropy_bits": ent})
                _log(f"{phase} step {step + 1}/{steps} ce {ce_avg:.3f} aux {aux_avg:.3f} "
                     f"lr {optimizer.learning_rate.item():.2e} {el / (step + 1):.2f}s/step "
                     f"{(step + 1) * B * L / el:.0f} tok/s entropy {ent} (max {math.log2(config['num_experts']):.0f})")
                counts_acc = None
        return history, time.time() - t0

    work.mkdir(parents=True, exist_ok=True)
    phase1 = work / "phase1.safetensors"
    if args.from_phase1:  # phase 1 as an earlier run of this script left it in --work
        model.load_weights(str(phase1))
        with open(work / "phase1.json") as f:
            done = json.load(f)
        history, seconds = done["history"], done["seconds"]
    else:
        history, seconds = run(cfg["steps"], cfg, text_batch, rng, "text")
        model.save_weights(str(phase1))
        with open(work / "phase1.json", "w") as f:
            json.dump({"history": history, "seconds": seconds}, f)
    # Phase 2, chat tuning: half the rows are conversations of mixed languages.
    chat_rng = random.Random(SEED + 1)
    chat_docs = [d for lang in LANGS for d in greeting_chats(lang, tune["chats"], chat_rng)]
    chat_ids = [e.ids for e in tok.encode_batch(chat_docs)]
    rng2 = np.random.default_rng(SEED + 1)
    h2, s2 = run(tune["steps"], tune, chat_batch, rng2, "chat")
    history += h2
    train_seconds = seconds + s2

    model.save_weights(str(work / "float.safetensors"))
    _log("evaluating the float model on held-out text")
    ev_float = evaluate(model, heldout_ids, L, top_k, max_tokens=args.eval_tokens)

    from mlx_lm import load as mlx_lm_load
    from mlx_lm.utils import dequantize_model, quantize_model, save_config, save_model

    model, qconfig = quantize_model(model, config, cfg["quant_group_size"], cfg["quant_bits"])
    if out.exists():
        for f in out.iterdir():
            if f.is_file() and f.name != ".gitignore":
                f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    (out / "model.safetensors.index.json").unlink(missing_ok=True)  # single shard: not needed
    save_config(qconfig, config_path=out / "config.json")
    for f in tok_dir.iterdir():
        shutil.copy(f, out / f.name)
    # The shipped checkpoint as mlx-lm loads it, its 4-bit weights dequantized to float32:
    # the same weights, but MLX's CPU quantized matmul runs at ~1 GFLOP/s.
    shipped, tok_shipped = mlx_lm_load(str(out))
    ev_q = evaluate(dequantize_model(shipped), heldout_ids, L, top_k, max_tokens=args.eval_tokens)

    heldout = {
        lang: {"loss_float": round(ev_float[lang]["loss"], 4), "loss_4bit": round(ev_q[lang]["loss"], 4),
               "ppl_4bit": round(math.exp(ev_q[lang]["loss"]), 2), "tokens": ev_q[lang]["tokens"],
               "usage_entropy_bits": [round(entropy_bits(r), 3) for r in ev_q[lang]["counts"]]}
        for lang in ev_q
    }
    for lang, h in heldout.items():
        _log(f"held-out {lang}: loss {h['loss_float']:.3f} (float) {h['loss_4bit']:.3f} (4-bit), "
             f"ppl {h['ppl_4bit']}, usage entropy {h['usage_entropy_bits']}")
    mix = sum(ev_q[lang]["counts"] for lang in ev_q)
    from mlx_lm import generate as mlx_lm_generate

    samples = {}
    for lang, prompt in SAMPLE_PROMPTS.items():
        samples[lang] = {"prompt": prompt, "greedy": mlx_lm_generate(shipped, tok_shipped, prompt, max_tokens=48)}
        _log(f"sample {lang}: {prompt!r} -> {samples[lang]['greedy']!r}")

    training = {
        "what": "mlxmoe's demo model: a qwen3_moe trained " + ("further, from the demo of " + args.continue_from
                                                            if args.continue_from else "from scratch")
                + " by demo/train_demo.py on Debian's multilingual man pages and fortunes",
        "command": "python demo/train_demo.py"
                   + ("" if not args.continue_from else f" --continue-from {args.continue_from}")
                   + ("" if args.steps is None else f" --steps {args.steps}")
                   + ("" if args.warmup is None else f" --warmup {args.warmup}")
                   + ("" if args.lr is None else f" --lr {args.lr:g}")
                   + ("" if not args.sampling_power else f" --sampling-power {args.sampling_power:g}")
                   + ("" if args.chat_steps is None else f" --chat-steps {args.chat_steps}")
                   + ("" if args.chat_lr is None else f" --chat-lr {args.chat_lr:g}")
                   + ("" if args.eval_tokens == EVAL_TOKENS else f" --eval-tokens {args.eval_tokens}"),
        **manifest,
        "model_config": MODEL_CONFIG,
        "vocab_size": vocab,
        "parameters": n_params,
        "hyperparameters": cfg,
        "chat_tuning": tune,
        "tokens_seen": (cfg["steps"] + tune["steps"]) * B * L + (earlier["tokens_seen"] if earlier else 0),
        **({"continued_from": {
            "revision": args.continue_from,
            "commit": (base / "commit").read_text().strip(),
            "what": "the demo model committed there, its 4-bit weights dequantized to float32 and its tokenizer "
                    "kept; both phases then ran again on top of it",
            "command": earlier["command"], "tokens_seen": earlier["tokens_seen"],
            "hyperparameters": earlier["hyperparameters"], "chat_tuning": earlier.get("chat_tuning"),
            "train_seconds": earlier["train_seconds"],
            "heldout_ppl_4bit": {k: v["ppl_4bit"] for k, v in earlier["heldout"].items()},
            "history": earlier["history"],
            **({"continued_from": earlier["continued_from"]} if "continued_from" in earlier else {}),
        }} if earlier else {}),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "blas": os.environ.get("MLXMOE_DEMO_BLAS", "default"),
                    "mlx": _version("mlx"), "mlx_lm": _version("mlx-lm"),
                    "tokenizers": _version("tokenizers"), "transformers": _version("transformers")},
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "final_train_ce": history[-1]["ce"] if history else None,
        "final_train_aux": history[-1]["aux"] if history else None,
        "heldout": heldout,
        "heldout_mix_usage_entropy_bits": [round(entropy_bits(r), 3) for r in mix],
        "samples_greedy": samples,
        "history": history,
    }
    with open(out / "training.json", "w") as f:
        json.dump(training, f, indent=1, ensure_ascii=False)
    same = out.resolve() == DEMO_DIR.resolve()
    write_heldout_samples(corpus, tok, HELDOUT_DIR if same else out / "heldout")
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    _log(f"saved {out} ({size / 1e6:.1f} MB) in {time.time() - t_start:.0f}s")
    return out


def git_commit(rev):
    r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"--continue-from: no commit {rev!r} in {REPO}")
    return r.stdout.strip()


def checkout_demo(rev, folder):
    """The demo model committed at `rev` (mlxmoe/demo/*) in `folder`/model, with its tokenizer
    files also in `folder`/tokenizer (as train_tokenizer writes them), and the commit's id in
    `folder`/commit. Kept there: a later run (or a machine without the repository's history)
    reuses it."""
    folder = Path(folder)
    if (folder / "commit").exists() and (folder / "model" / "training.json").exists():
        return folder
    commit = git_commit(rev)
    names = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", commit, "mlxmoe/demo/"],
                           capture_output=True, text=True, check=True).stdout.split()
    for sub in ("model", "tokenizer"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    for name in names:
        data = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{name}"], capture_output=True,
                              check=True).stdout
        base = Path(name).name
        (folder / "model" / base).write_bytes(data)
        if base.startswith("tokenizer") or base == "chat_template.jinja":
            (folder / "tokenizer" / base).write_bytes(data)
    (folder / "commit").write_text(commit + "\n")
    return folder


def _version(dist):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


SAMPLE_CHARS = 8000  # per language and kind in bench/data/heldout/
EVAL_TOKENS = 30_000  # held-out tokens per language and kind evaluated into training.json


def heldout_sample(docs, limit=SAMPLE_CHARS, seed=SEED):
    """A few KB of held-out documents, whole ones where they fit (long pages are cut at a
    paragraph), in a seeded order."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    out, n = [], 0
    for i in order:
        d = docs[i]
        room = min(limit - n, 3000)
        if room < 200:
            break
        if len(d) > room:
            cut = d.rfind("\n\n", 0, room)
            d = d[:cut] if cut > 200 else d[:room]
        out.append(d)
        n += len(d)
    return out


def write_heldout_samples(corpus, tok, folder=HELDOUT_DIR):
    """bench/data/heldout/{lang}.{kind}.txt (documents separated by <|endoftext|>) and the
    training split's unigram counts, for bench/demo_routing.py on a machine without the corpus."""
    import numpy as np

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for lang in LANGS:
        for kind in KINDS:
            docs = corpus[lang][kind]["heldout"]
            if docs:
                (folder / f"{lang}.{kind}.txt").write_text(EOT.join(heldout_sample(docs)) + EOT, encoding="utf-8")
    counts = np.zeros(tok.get_vocab_size(), dtype=np.int64)
    for lang in LANGS:
        for kind in KINDS:
            ids = encode_docs(tok, corpus[lang][kind]["train"])
            counts += np.bincount(ids, minlength=len(counts))
    with open(folder / "unigram_train_counts.json", "w") as f:
        json.dump({"what": "token counts of the whole training split (all languages), for the unigram "
                           "baseline of bench/demo_routing.py", "counts": counts.tolist()}, f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(DEMO_DIR), help="Where the 4-bit model goes (default: mlxmoe/demo).")
    parser.add_argument("--work", default=str(DEFAULT_WORK), help="Corpus cache, tokenizer and float weights.")
    parser.add_argument("--steps", type=int, default=None, help=f"Training steps (default {TRAIN['steps']}).")
    parser.add_argument("--chat-steps", type=int, default=None,
                        help=f"Chat-tuning steps (default {CHAT_TUNE['steps']}).")
    parser.add_argument("--warmup", type=int, default=None, help=f"Warmup steps (default {TRAIN['warmup']}).")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"Peak rate of the text phase (default {TRAIN['lr']}, {CONTINUE['lr']} with --continue-from).")
    parser.add_argument("--chat-lr", type=float, default=None,
                        help=f"Peak rate of the chat phase (default {CHAT_TUNE['lr']}).")
    parser.add_argument("--sampling-power", type=float, default=0.0,
                        help="Draw a text row's language in proportion to its training tokens to this power "
                             "(default 0: uniform; 0.5 gives the larger languages more rows).")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--eval-tokens", type=int, default=EVAL_TOKENS, help="Held-out tokens per language and kind.")
    parser.add_argument("--rebuild-corpus", action="store_true")
    parser.add_argument("--from-phase1", action="store_true",
                        help="Start from the phase-1 weights an earlier run saved in --work (chat tuning on).")
    parser.add_argument("--continue-from", metavar="REV", default=None,
                        help="Start from the demo model committed at git revision REV (its tokenizer kept) "
                             "instead of from scratch.")
    parser.add_argument("--corpus-only", action="store_true", help="Build the corpus and stop.")
    args = parser.parse_args(argv)
    ensure_fast_blas()
    if args.corpus_only:
        _, manifest = build_corpus(Path(args.work), rebuild=args.rebuild_corpus)
        print(json.dumps(manifest["sizes"], indent=1))
        return
    train(args)


if __name__ == "__main__":
    main()
