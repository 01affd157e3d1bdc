"""The `mlxmoe` command: generate, chat, info."""

import json
import sys
import time

import click

from .errors import MlxmoeError


def model_options(f):
    """Options shared by every command that loads a model."""
    options = [
        click.option("--model", "-m", "model_path", required=True, help="Model folder (or Hugging Face repo id)."),
        click.option("--memory-budget", help="Memory for the whole model: resident weights + KV cache + expert "
                     "cache, e.g. 12GB. Default: 60% of this machine's memory."),
        click.option("--cache-size", help="Expert cache size in bytes (e.g. 2GB); overrides the budget's share."),
        click.option("--cache-experts", type=int, help="Expert cache size as a number of experts (all layers)."),
        click.option("--policy", help="Eviction policy (default: lru)."),
        click.option("--backend", type=click.Choice(["cpu", "metal", "cuda"]), help="Default: the best available."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def sampling_options(f):
    options = [
        click.option("--max-tokens", type=int, default=256, show_default=True, help="Tokens to generate."),
        click.option("--temp", type=float, default=0.0, show_default=True, help="Sampling temperature (0: greedy)."),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass."),
        click.option("--seed", type=int, default=0, show_default=True, help="Random seed."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _load(opts):
    from . import load

    return load(opts["model_path"], memory_budget=opts["memory_budget"], cache_size=opts["cache_size"],
                cache_experts=opts["cache_experts"], policy=opts["policy"], backend=opts["backend"])


def _sampler(temp, top_p, seed):
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    return make_sampler(temp, top_p)


def summary(stats, before, elapsed_tokens, tps):
    """One line per reply: speed, hit rate and MB read since `before`."""
    hits = stats["hits"] - before["hits"]
    total = hits + stats["misses"] - before["misses"]
    mb = (stats["bytes_read"] - before["bytes_read"]) / 1e6
    rate = f"{100 * hits / total:.1f}%" if total else "n/a"
    return f"[{elapsed_tokens} tokens, {tps:.1f} tok/s, expert hit rate {rate}, {mb:.1f} MB read]"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlxmoe")
def main():
    """Run Mixture-of-Experts models larger than memory: experts stream from disk
    through a cache that keeps the ones your workload uses."""


@main.command()
@model_options
@sampling_options
@click.option("--prompt", "-p", required=True, help="The prompt ('-' reads standard input).")
@click.option("--chat-template/--no-chat-template", default=False, help="Wrap the prompt in the chat template.")
@click.option("--stats-json", type=click.Path(dir_okay=False), help="Write the cache stats to this file.")
def generate(prompt, chat_template, stats_json, max_tokens, temp, top_p, seed, **opts):
    """Generate text from a prompt, streaming it to standard output."""
    from .api import stream_generate

    model, tokenizer = _load(opts)
    if prompt == "-":
        prompt = sys.stdin.read()
    if chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    response = None
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                    sampler=_sampler(temp, top_p, seed)):
        click.echo(response.text, nl=False)
    click.echo()
    stats = model.expert_cache.stats()
    if response is not None:
        click.echo(f"prompt: {response.prompt_tokens} tokens at {response.prompt_tps:.1f} tok/s; "
                   f"generation: {response.generation_tokens} tokens at {response.generation_tps:.1f} tok/s", err=True)
    click.echo(f"experts: hit rate {100 * stats['hit_rate']:.1f}%, {stats['misses']} loads, "
               f"{stats['bytes_read'] / 1e6:.1f} MB read, cache {stats['cache_experts']} experts "
               f"({stats['cache_bytes'] / 1e6:.1f} MB), peak memory {stats['peak_memory'] / 1e6:.1f} MB", err=True)
    if stats_json:
        with open(stats_json, "w") as f:
            json.dump(stats, f, indent=1)


@main.command()
@model_options
@sampling_options
@click.option("--system-prompt", help="System message for the chat template.")
def chat(system_prompt, max_tokens, temp, top_p, seed, **opts):
    """Chat with the model. The KV cache carries over between turns; after each reply a
    line gives tokens/s, the expert hit rate and MB read. Type /reset to start over,
    /stats for the cache's stats, /quit (or Ctrl-D) to leave."""
    from mlx_lm.models.cache import make_prompt_cache

    from .api import stream_generate

    model, tokenizer = _load(opts)
    cache = model.expert_cache
    sampler = _sampler(temp, top_p, seed)
    prompt_cache = make_prompt_cache(model)
    first = True
    click.echo(f"mlxmoe chat: {opts['model_path']} with {cache.capacity} experts cached. /quit to leave.", err=True)
    while True:
        try:
            query = input(">> ")
        except (EOFError, KeyboardInterrupt):
            click.echo()
            break
        if query.strip() in ("/quit", "/exit", "q"):
            break
        if query.strip() == "/reset":
            prompt_cache, first = make_prompt_cache(model), True
            continue
        if query.strip() == "/stats":
            click.echo(json.dumps(cache.stats(), indent=1))
            continue
        messages = [{"role": "system", "content": system_prompt}] if system_prompt and first else []
        messages.append({"role": "user", "content": query})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        before = cache.stats()
        response = None
        try:
            for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler,
                                            prompt_cache=prompt_cache):
                click.echo(response.text, nl=False)
        except KeyboardInterrupt:
            click.echo("\n[interrupted]")
            prompt_cache, first = make_prompt_cache(model), True
            continue
        first = False
        click.echo()
        if response is not None:
            click.echo(summary(cache.stats(), before, response.generation_tokens, response.generation_tps), err=True)


@main.command()
@click.option("--model", "-m", "model_path", required=True, help="Model folder (or Hugging Face repo id).")
@click.option("--memory-budget", help="Show what this budget buys, e.g. 12GB.")
@click.option("--backend", type=click.Choice(["cpu", "metal", "cuda"]), help="Default: the best available.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def info(model_path, memory_budget, backend, as_json):
    """Architecture, experts, bytes of resident weights and of one expert, the smallest
    budget that works and what a given budget buys. Reads headers only."""
    from . import backend as backends
    from .api import memory_plan
    from .budget import format_size
    from .loader import open_checkpoint

    be = backends.detect(backend)
    ckpt = open_checkpoint(model_path)
    be.apply_dtype_policy(ckpt.model)
    minimal = memory_plan(ckpt, be, cache_experts=ckpt.top_k)
    total = ckpt.num_layers * ckpt.num_experts
    out = {
        "model": str(ckpt.path), "model_type": ckpt.config["model_type"], "backend": be.name,
        "moe_layers": ckpt.num_layers, "experts_per_layer": ckpt.num_experts, "top_k": ckpt.top_k,
        "expert_tensors": dict(zip(ckpt.store.tensors, ckpt.store.tensor_dtypes)),
        "expert_bytes": minimal.slot_bytes, "expert_bytes_on_disk": ckpt.store.expert_file_bytes(),
        "all_experts_bytes": total * minimal.slot_bytes, "resident_bytes": minimal.resident,
        "kv_reserve_bytes": minimal.kv_reserve, "working_bytes": minimal.working,
        "minimum_budget": minimal.minimum,
        "all_resident_budget": minimal.minimum + (total - ckpt.top_k) * minimal.slot_bytes,
    }
    if memory_budget:
        p = memory_plan(ckpt, be, memory_budget)
        out["budget"] = {"budget": p.budget, "cache_experts": p.cache_experts, "cache_bytes": p.expert_cache,
                         "share_of_experts": p.cache_experts / total}
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    click.echo(f"{out['model']}: {out['model_type']} on {be.name}")
    click.echo(f"  {out['moe_layers']} MoE layers x {out['experts_per_layer']} experts, top-{out['top_k']}")
    click.echo(f"  one expert: {format_size(out['expert_bytes'])} in memory "
               f"({format_size(out['expert_bytes_on_disk'])} on disk); all experts {format_size(out['all_experts_bytes'])}")
    click.echo(f"  resident weights: {format_size(out['resident_bytes'])}, KV reserve {format_size(out['kv_reserve_bytes'])}, "
               f"working memory {format_size(out['working_bytes'])}")
    click.echo(f"  smallest budget that works: {format_size(out['minimum_budget'])}; "
               f"everything resident: {format_size(out['all_resident_budget'])}")
    if memory_budget:
        b = out["budget"]
        click.echo(f"  {memory_budget} buys {b['cache_experts']} experts ({format_size(b['cache_bytes'])}), "
                   f"{100 * b['share_of_experts']:.1f}% of all experts")


def run():
    """Entry point: bad input prints one clear line, not a traceback."""
    try:
        main(standalone_mode=False)
    except MlxmoeError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
