"""`--model demo` from any folder, and generate's and chat's mlx-lm options (issue 44, items
1-2): each gives the text stock mlx-lm gives with the same option on the same model (the
demo model, mlx-lm run with mlxmoe's dtype policy), --stop cuts the reply where it should,
a bad value is one line naming the option."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from click.testing import CliRunner
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import mlxmoe
from mlxmoe.backend import detect
from mlxmoe.cli import main
from mlxmoe.loader import resolve
from mlxmoe.storage.files import model_folder

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Describe the tar command in detail."
TOKENS = 32
STREAMED = ["--cache-experts", "24"]  # a fifth of the demo's experts: they stream


@pytest.fixture(scope="module")
def stock():
    model, tokenizer = mlx_lm.load(str(mlxmoe.DEMO_MODEL))
    return detect().apply_dtype_policy(model), tokenizer


def stock_text(stock, prompt=PROMPT, system=None, template=True, template_config=None, seed=None, penalty=None,
               context=20, sampling=None, **kwargs):
    """What mlx_lm.generate's command prints for these options (its main(), step by step)."""
    model, tokenizer = stock
    if template:
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": prompt})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                               **(template_config or {}))
        if "prompt_cache" in kwargs:  # only what follows the cached prefix
            messages[-1]["content"] = "<query>"
            prompt = prompt[tokenizer.apply_chat_template(messages, tokenize=False,
                                                          add_generation_prompt=True).index("<query>"):]
    ids = tokenizer.encode(prompt, add_special_tokens=not template)
    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(**(sampling or {}),
                           xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids))
    processors = make_logits_processors(repetition_penalty=penalty, repetition_context_size=context)
    return mlx_lm.generate(model, tokenizer, ids, max_tokens=kwargs.pop("max_tokens", TOKENS), sampler=sampler,
                           logits_processors=processors, **kwargs)


def cli_generate(*flags, prompt=PROMPT):
    r = CliRunner().invoke(main, ["generate", "-p", prompt, "--max-tokens", str(TOKENS), *STREAMED, *flags])
    assert r.exit_code == 0, r.output
    return r


CASES = {
    "system-prompt": (["--system-prompt", "Answer in Italian."], {"system": "Answer in Italian."}),
    "ignore-chat-template": (["--ignore-chat-template"], {"template": False}),
    "top-k": (["--temp", "1.0", "--top-k", "3", "--seed", "11"],
              {"seed": 11, "sampling": {"temp": 1.0, "top_k": 3}}),
    "min-p": (["--temp", "1.0", "--min-p", "0.3", "--min-tokens-to-keep", "2", "--seed", "12"],
              {"seed": 12, "sampling": {"temp": 1.0, "min_p": 0.3, "min_tokens_to_keep": 2}}),
    "xtc": (["--temp", "0.8", "--xtc-probability", "0.5", "--xtc-threshold", "0.2", "--seed", "13"],
            {"seed": 13, "sampling": {"temp": 0.8, "xtc_probability": 0.5, "xtc_threshold": 0.2}}),
    "repetition-penalty": (["--repetition-penalty", "1.5", "--repetition-context-size", "8"],
                           {"penalty": 1.5, "context": 8}),
    "max-kv-size": (["--max-kv-size", "12"], {"max_kv_size": 12}),
    "kv-bits": (["--kv-bits", "3", "--quantized-kv-start", "0"], {"kv_bits": 3, "quantized_kv_start": 0}),
    "kv-bits 8, group 32": (["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "8"],
                            {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 8}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_generate_option_matches_mlx_lm(stock, name):
    flags, kwargs = CASES[name]
    want = stock_text(stock, **kwargs)
    assert len(want) > 20
    assert cli_generate(*flags).stdout == want + "\n"


def test_options_change_the_output(stock):
    """The options above do something on this model (else the comparisons prove little)."""
    plain = stock_text(stock)
    for name in ("system-prompt", "top-k", "repetition-penalty", "max-kv-size", "kv-bits"):
        assert stock_text(stock, **CASES[name][1]) != plain, name


def test_chat_template_config(stock, tmp_path):
    """--chat-template-config's keywords reach the template, as mlx_lm.generate passes them."""
    folder = tmp_path / "greeter"
    shutil.copytree(mlxmoe.DEMO_MODEL, folder)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text("{% if greeting %}{{ greeting }}\n{% endif %}" + template)
    model, tokenizer = mlx_lm.load(str(folder))
    detect().apply_dtype_policy(model)
    config = {"greeting": "Rispondi in italiano."}
    want = stock_text((model, tokenizer), template_config=config)
    assert want != stock_text((model, tokenizer))
    r = cli_generate("--model", str(folder), "--chat-template-config", json.dumps(config))
    assert r.stdout == want + "\n"


def test_verbose_false_prints_the_reply_alone(stock):
    r = cli_generate("--verbose", "False")
    assert r.stdout == stock_text(stock) + "\n" and r.stderr == ""


def test_prompt_cache_file(stock, tmp_path):
    """A KV cache saved as mlx_lm.cache_prompt saves it: the prompt continues it, --model
    defaults to the cache's model, and the output is stock mlx-lm's from the same cache."""
    from mlx_lm.models.cache import load_prompt_cache

    model, tokenizer = stock
    path = tmp_path / "prefix.safetensors"
    cache = make_prompt_cache(model)
    model(mx.array(tokenizer.encode("The ls command lists"))[None], cache=cache)
    mx.eval([c.state for c in cache])
    save_prompt_cache(str(path), cache, {"model": str(mlxmoe.DEMO_MODEL), "tokenizer_config": "{}"})
    for template in (False, True):
        flags = [] if template else ["--raw"]
        want = stock_text(stock, " the files of", template=template, prompt_cache=load_prompt_cache(str(path)))
        r = CliRunner().invoke(main, ["generate", "-p", " the files of", "--prompt-cache-file", str(path),
                                      "--max-tokens", str(TOKENS), *STREAMED, *flags])
        assert r.exit_code == 0, r.output
        assert r.stdout == want + "\n", template
    # made with another model: refused, naming both
    r = CliRunner().invoke(main, ["generate", "-p", "x", "--prompt-cache-file", str(path), "--model", str(ROOT)])
    assert r.exit_code == 2 and "was made with the model" in r.output


def test_stop_ends_the_reply_at_the_first_stop_string(stock):
    want = stock_text(stock)
    first, later = want[12:15], want[20:26]  # (spanning tokens, likely)
    assert first not in want[:12]
    for stops in ([first], [later, first], [first, "never there"]):
        args = [a for s in stops for a in ("--stop", s)]
        assert cli_generate(*args).stdout == want[:want.index(first)] + "\n", stops
    # a stop string whose start ends the reply: held back, then printed when no stop came
    assert cli_generate("--stop", want[-3:] + "ZZZ").stdout == want + "\n"


def test_chat_takes_the_options(stock):
    """chat: the KV cache options, the sampler's and --stop, against stock mlx-lm with chat's
    repetition penalty; --verbose False leaves out the figures line."""
    model, tokenizer = stock
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    cache = make_prompt_cache(model)
    want = mlx_lm.generate(model, tokenizer, ids, max_tokens=TOKENS, prompt_cache=cache, kv_bits=4,
                           quantized_kv_start=0, sampler=make_sampler(0.0, top_k=5),
                           logits_processors=make_logits_processors(repetition_penalty=1.3,
                                                                    repetition_context_size=64))
    stop = want[10:13]
    r = CliRunner().invoke(main, ["chat", "--max-tokens", str(TOKENS), *STREAMED, "--kv-bits", "4",
                                  "--quantized-kv-start", "0", "--top-k", "5", "--stop", stop, "--verbose", "F"],
                           input=PROMPT + "\n")
    assert r.exit_code == 0, r.output
    assert r.stdout == f">> {want[:want.index(stop)]}\n>> \n"
    assert "hit rate" not in r.stderr


@pytest.mark.parametrize("flags,option", [
    (["--top-k", "-1"], "--top-k"), (["--min-p", "1.5"], "--min-p"), (["--kv-bits", "7"], "--kv-bits"),
    (["--kv-group-size", "48"], "--kv-group-size"), (["--max-kv-size", "2"], "--max-kv-size"),
    (["--quantized-kv-start", "-3"], "--quantized-kv-start"), (["--xtc-threshold", "0.9"], "--xtc-threshold"),
    (["--chat-template-config", "{oops"], "--chat-template-config"),
    (["--chat-template-config", "[1, 2]"], "--chat-template-config"), (["--stop", ""], "--stop"),
    (["--verbose", "maybe"], "--verbose"), (["--repetition-context-size", "0"], "--repetition-context-size"),
    (["--repetition-penalty", "nan"], "--repetition-penalty"), (["--min-tokens-to-keep", "0"], "--min-tokens-to-keep"),
    (["--kv-bits", "4", "--max-kv-size", "64"], "--max-kv-size and --kv-bits"),
    (["--prompt-cache-file", "/nonexistent/cache.safetensors"], "--prompt-cache-file"),
])
def test_bad_values_are_one_line_naming_the_option(cli, flags, option):
    code, err = cli("generate", "-p", "hi", *flags)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and option in lines[0], err


def test_demo_by_name_from_any_folder(tmp_path):
    """`--model demo` is the bundled model from any folder (not a hub id); a folder named
    demo in the current directory wins, for the loader and for model_folder alike."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    runs = [subprocess.run([sys.executable, "-m", "mlxmoe", "generate", *model, "-p", "Ciao! Come stai?",
                            "--max-tokens", "6"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
            for model in (["--model", "demo"], [])]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.strip()
    help_text = " ".join(CliRunner().invoke(main, ["generate", "--help"]).stdout.split())
    assert "`demo` (the default)" in help_text and "a folder named demo in the current directory wins" in help_text
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert resolve("demo") == model_folder("demo") == mlxmoe.DEMO_MODEL
        (tmp_path / "demo").mkdir()
        shutil.copy(mlxmoe.DEMO_MODEL / "config.json", tmp_path / "demo")
        assert resolve("demo").resolve() == model_folder("demo").resolve() == (tmp_path / "demo")
    finally:
        os.chdir(old)
