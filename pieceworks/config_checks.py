"""The checks of every configuration value (`validate`, called by `pieceworks.config.load_config` on the
merged, normalized Config): ranges, choices, and the combinations that can't work together."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pieceworks.errors import ConfigError

INT_MAX = 2**31 - 1
"""The largest size or count a config (or a model's config.json) may give: far past any model or cache, and small
enough that the product of two (a weight's elements) stays within torch's 64-bit sizes."""

OPS = ("attention", "mla", "fp4_gemm", "moe")
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_TIMEOUT_S = 1_000_000  # a pipe's poll takes at most about 2.1e6 s (milliseconds in a C int)


def _one_of(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not allowed; use one of {', '.join(map(str, allowed))}")


def _positive(key: str, value: Any) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{key}: {value!r} must be >= 1")
    if value is not None and value > INT_MAX:
        raise ConfigError(f"{key}: {value!r} must be at most {INT_MAX}")


def _sizes(key: str, value: list[int] | None) -> None:
    if value is None:
        return
    if not value:
        raise ConfigError(f"{key}: the list is empty; give at least one size, or leave it unset")
    if any(not isinstance(v, int) or v < 1 for v in value):
        raise ConfigError(f"{key}: {value} must hold positive integers")
    if list(value) != sorted(set(value)):
        raise ConfigError(f"{key}: {value} must be strictly ascending without repeats")


def validate(cfg: Any, require_model: bool = True) -> None:
    """ConfigError naming the key, the value and what is allowed, for the first bad value of a normalized
    `pieceworks.config.Config` (the schema's types are checked before, when the YAML is merged)."""
    m = cfg.model
    if require_model and m.path is None and m.arch is None:
        raise ConfigError(
            "model: set model.path (a Hugging Face-format directory, or smollm2-135m / smollm2-135m-fp4) "
            "or model.arch (llama or deepseek_v3) for random weights"
        )
    if m.path is not None and not str(m.path).strip():
        raise ConfigError("model.path: empty; give a model directory (Hugging Face format) or smollm2-135m / "
                          "smollm2-135m-fp4")
    if m.path is not None and m.arch is not None:
        raise ConfigError("model: set model.path or model.arch, not both")
    if m.arch is not None:
        _one_of("model.arch", m.arch, ("llama", "deepseek_v3"))
    elif m.path is not None and (m.preset is not None or m.sizes):
        key = "model.preset" if m.preset is not None else "model.sizes"
        raise ConfigError(f"{key}: shapes the random-weight model of model.arch; with model.path the checkpoint's "
                          "config.json gives the shape: drop it, or use model.arch instead of model.path")
    _positive("model.max_context", m.max_context)
    _one_of("quantization.format", cfg.quantization.format, ("auto", "none", "nvfp4"))
    _one_of("quantization.fp4_numerics", cfg.quantization.fp4_numerics, ("auto", "w4a4", "w4a16"))
    kv = cfg.kv_cache
    _positive("kv_cache.page_size", kv.page_size)
    _positive("kv_cache.num_tokens", kv.num_tokens)
    if not 0.0 < kv.memory_fraction <= 1.0:
        raise ConfigError(f"kv_cache.memory_fraction: {kv.memory_fraction!r} must be in (0, 1]")
    _one_of("kv_cache.dtype", kv.dtype, ("auto", "model", "fp8"))
    for op in OPS:
        sel = getattr(cfg.backends, op)
        if isinstance(sel, str):
            continue
        if isinstance(sel, dict) and sel and set(sel) <= {"extend", "decode"}:
            if all(isinstance(v, str) for v in sel.values()):
                continue
        raise ConfigError(
            f"backends.{op}: {sel!r} is not allowed; use auto, a backend name, or "
            "{extend: <name>, decode: <name>} (a mode left out is auto)"
        )
    for name, opts in cfg.backends.options.items():
        if not isinstance(opts, dict):
            raise ConfigError(f"backends.options.{name}: {opts!r} must be a mapping of option: value")
    _positive("scheduler.max_num_seqs", cfg.scheduler.max_num_seqs)
    _positive("scheduler.max_num_batched_tokens", cfg.scheduler.max_num_batched_tokens)
    if not 0.0 <= cfg.scheduler.watermark < 1.0:
        raise ConfigError(f"scheduler.watermark: {cfg.scheduler.watermark!r} must be in [0, 1)")
    sp = cfg.speculative
    if sp.method is not None:
        _one_of("speculative.method", sp.method, ("ngram",))
    for key, most in (("num_speculative_tokens", 64), ("prompt_lookup_max", 32), ("prompt_lookup_min", 32)):
        _positive(f"speculative.{key}", getattr(sp, key))
        if getattr(sp, key) > most:  # each token indexes max - min + 1 n-grams of up to max tokens
            raise ConfigError(f"speculative.{key}: {getattr(sp, key)} is more than {most}, which costs host time and "
                              "memory per token without drafting better; use at most that")
    if sp.max_batch is not None:
        _positive("speculative.max_batch", sp.max_batch)
    if sp.prompt_lookup_min > sp.prompt_lookup_max:
        raise ConfigError(f"speculative.prompt_lookup_min ({sp.prompt_lookup_min}) exceeds prompt_lookup_max "
                          f"({sp.prompt_lookup_max}); lower it or raise prompt_lookup_max")
    pw = cfg.cuda_graph.piecewise
    _positive("cuda_graph.piecewise.max_tokens", pw.max_tokens)
    _sizes("cuda_graph.piecewise.sizes", pw.sizes)
    if pw.sizes and pw.sizes[0] == 1:  # torch specializes a dimension of size 1: no graph over several sizes
        raise ConfigError(f"cuda_graph.piecewise.sizes: {list(pw.sizes)} starts at 1; the piecewise graphs' token "
                          "dimension is traced dynamic, which torch fixes at a size of 1: start at 2 (a one-token "
                          "step runs in the 2-token graph)")
    if pw.sizes and pw.sizes[-1] > pw.max_tokens:
        raise ConfigError(f"cuda_graph.piecewise.sizes: {pw.sizes[-1]} is above cuda_graph.piecewise.max_tokens "
                          f"({pw.max_tokens}), the largest step piecewise graphs take; raise max_tokens or drop the "
                          "larger sizes")
    _sizes("cuda_graph.decode.batch_sizes", cfg.cuda_graph.decode.batch_sizes)
    _sizes("cuda_graph.extend.sizes", cfg.cuda_graph.extend.sizes)
    _positive("cuda_graph.extend.max_seqs", cfg.cuda_graph.extend.max_seqs)
    dev = cfg.runtime.device
    index = dev[5:] if dev.startswith("cuda:") else ""
    if not (dev in ("auto", "cpu", "cuda") or (index.isascii() and index.isdigit() and int(index) < 128)):
        raise ConfigError(f"runtime.device: {dev!r} is not allowed; use auto, cpu, cuda or cuda:N (N a GPU's index, "
                          "0-127)")
    _one_of("runtime.dtype", cfg.runtime.dtype, ("auto", "bfloat16", "float16", "float32"))
    if cfg.runtime.cache_dir is not None and not str(cfg.runtime.cache_dir).strip():
        raise ConfigError("runtime.cache_dir: empty; give a directory, or null for the default (~/.cache/pieceworks, "
                          "or $XDG_CACHE_HOME/pieceworks)")
    if cfg.runtime.cache_dir:
        try:
            cache = Path(cfg.runtime.cache_dir).expanduser()
        except RuntimeError:  # ~user of no user
            raise ConfigError(f"runtime.cache_dir: {cfg.runtime.cache_dir}: no home directory for its ~user; give "
                              "an absolute path") from None
        if cache.exists() and not cache.is_dir():
            raise ConfigError(f"runtime.cache_dir: {cfg.runtime.cache_dir} is a file; give a directory (it is "
                              "created where missing), or leave it unset")
    lo, hi = SEED_RANGE
    if not lo <= cfg.runtime.seed <= hi:
        raise ConfigError(f"runtime.seed: {cfg.runtime.seed!r} is out of range; use an integer from "
                          f"-2**63 to 2**64 - 1 ({lo} to {hi})")
    par = cfg.parallel
    _positive("parallel.tensor_parallel_size", par.tensor_parallel_size)
    if par.tensor_parallel_size > 1 and dev.startswith("cuda:"):
        raise ConfigError(f"runtime.device: {dev!r} names one GPU, but parallel.tensor_parallel_size is "
                          f"{par.tensor_parallel_size}; use runtime.device=cuda (rank r runs on GPU r)")
    if not 0 < par.timeout_s <= MAX_TIMEOUT_S:
        raise ConfigError(f"parallel.timeout_s: {par.timeout_s!r} must be > 0 and at most {MAX_TIMEOUT_S:,} "
                          "(11 days)")
    g = cfg.generation
    _positive("generation.max_new_tokens", g.max_new_tokens)
    if g.temperature is not None and not (math.isfinite(g.temperature) and g.temperature >= 0):
        raise ConfigError(f"generation.temperature: {g.temperature!r} must be a finite number >= 0")
    if g.top_p is not None and not 0.0 < g.top_p <= 1.0:
        raise ConfigError(f"generation.top_p: {g.top_p!r} must be in (0, 1]")
    if not all(isinstance(x, str) for x in g.prompts):
        raise ConfigError(f"generation.prompts: {g.prompts!r} must be a list of strings (text prompts)")
