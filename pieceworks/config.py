"""Configuration: one small dataclass per component, the schema of the YAML files.

`load_config(path_or_dict, overrides)` merges YAML and dotlist overrides onto these schemas (OmegaConf;
the reading, merging and error locating live in `pieceworks.config_yaml`), checks every value
(`pieceworks.config_checks`) and returns a frozen `Config` of plain Python objects; nothing downstream touches
OmegaConf (an attribute read there costs ~20 us). Errors are `ConfigError`s naming the key, the bad value and
what is allowed; a field's `example` metadata is the value such a message suggests for it (e.g. for a scalar
given to a list field).
"""

from __future__ import annotations

import enum
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from pieceworks.config_checks import validate
from pieceworks.config_yaml import as_dict, merge, plain, to_yaml, with_location
from pieceworks.environment import user_cache_home
from pieceworks.errors import ConfigError  # re-exported here for callers of load_config

class Switch(str, enum.Enum):
    """auto = on where it helps (CUDA), off elsewhere."""

    auto = "auto"
    on = "on"
    off = "off"


class Policy(str, enum.Enum):
    """How the scheduler orders waiting requests: by arrival, or by (priority, arrival)."""

    fcfs = "fcfs"
    priority = "priority"


@dataclass(frozen=True)
class ModelConfig:
    """Which model to build.

    Either `path` (a Hugging Face-format directory: config.json + safetensors, bf16 or ModelOpt NVFP4),
    or `arch` (+ optional `preset` and `sizes`) for random weights of a given shape.
    """

    path: Optional[str] = None
    """Hugging Face-format model directory, or `smollm2-135m` (bf16) / `smollm2-135m-fp4` (NVFP4) for the demo
    model."""
    arch: Optional[str] = None
    """`llama` or `deepseek_v3`: build with random weights (benchmarks, tests)."""
    preset: Optional[str] = None
    """Named sizes for `arch` (models/presets.py): llama: tiny, llama-3.1-8b, mixtral-8x7b, qwen3-30b-a3b,
    glm-4.5-air, gemma-3-1b, gemma-2-2b; deepseek_v3: tiny, deepseek-v3, deepseek-v2-lite, glm-4.7-flash."""
    sizes: dict[str, Any] = field(default_factory=dict, metadata={"example": "{num_hidden_layers: 4}"})
    """Hugging Face config keys overriding the preset, e.g. {num_hidden_layers: 4}."""
    max_context: Optional[int] = None
    """Longest sequence (prompt + generated) accepted; default: the model's max_position_embeddings. The
    rope tables cover this many positions (a checkpoint whose max_position_embeddings would need more than
    1 GiB of them must set it)."""
    allow_extra_tensors: bool = False
    """Load a checkpoint that holds tensors the model does not read (ignoring them). Off: such tensors
    (a bias config.json says is absent, layers beyond num_hidden_layers, an lm_head of a tied model)
    mean the checkpoint does not match its config.json, and loading fails naming them."""


@dataclass(frozen=True)
class QuantizationConfig:
    format: str = "auto"
    """auto (from the checkpoint), none, or nvfp4 (random-weight models: random NVFP4 weights)."""
    fp4_numerics: str = "auto"
    """auto (follow the selected kernel: w4a4 on Blackwell FP4 kernels, w4a16 on Hopper/CPU), w4a4
    (activations quantized with input_scale) or w4a16 (weight-only); naming one restricts selection."""


@dataclass(frozen=True)
class KVCacheConfig:
    page_size: int = 16
    """Tokens per KV page."""
    num_tokens: Optional[int] = None
    """KV pool size in tokens; when unset, `memory_fraction` of the memory left after weights."""
    memory_fraction: float = 0.85
    """Fraction of free device memory (CUDA) or of available RAM (CPU, capped at 16384 tokens) for KV."""
    dtype: str = "auto"
    """What the pool stores K/V as: model (the model dtype), fp8 (e4m3 with per-layer k/v scales: the
    checkpoint's k_scale / v_scale where it has them, else 1.0; half the bytes per token, so twice the tokens
    and half the attention reads) or auto (fp8 where the checkpoint's quantization config asks for an FP8 KV
    cache, as ModelOpt writes it with its FP8 KV config; else the model dtype). Served by the GQA attention backends
    torch, triton and flashinfer; MLA models refuse fp8."""
    prefix_caching: bool = True
    """Keep full KV pages keyed by their token prefix, so a request that starts with tokens another one
    computed (a shared system prompt, the n completions of one prompt) takes those pages instead of
    recomputing them; unreferenced cached pages are evicted least recently used when the pool is full."""


@dataclass(frozen=True)
class BackendsConfig:
    """Per-op backend selection: `auto`, a backend name, or {extend: <name>, decode: <name>}; a mode
    left out of the mapping is `auto` (`{extend: torch}` pins extend and lets decode choose)."""

    attention: Any = "auto"
    mla: Any = "auto"
    fp4_gemm: Any = "auto"
    moe: Any = "auto"
    options: dict[str, Any] = field(default_factory=dict, metadata={"example": "{flashinfer: {variant: fa2}}"})
    """Per-backend options by backend name, e.g. {flashinfer: {variant: fa2}}."""

    def choice(self, op: str, mode: str) -> str:
        """The configured name for `op` in forward mode `mode` ('extend' or 'decode')."""
        sel = getattr(self, op)
        return sel.get(mode, "auto") if isinstance(sel, dict) else sel


@dataclass(frozen=True)
class PiecewiseConfig:
    enabled: Any = Switch.auto
    """auto | on | off (YAML true/false too): piecewise CUDA graphs for extend/mixed steps (auto: on
    with CUDA). On CPU `on` runs the same traced-and-split model without graphs (what CI tests)."""
    max_tokens: int = 2048
    """Largest token count run under piecewise graphs; larger steps run eagerly."""
    sizes: Optional[list[int]] = field(default=None, metadata={"example": "[16,32,64]"})
    """Capture sizes (ascending); default: steps of 4 to 32, 16 to 256, 32 to 512, 64 to 1024, 256
    beyond, up to max_tokens."""


@dataclass(frozen=True)
class DecodeGraphConfig:
    enabled: Any = Switch.auto
    """auto | on | off (YAML true/false too): full CUDA graphs for decode steps (auto: on with CUDA;
    never on CPU)."""
    batch_sizes: Optional[list[int]] = field(default=None, metadata={"example": "[1,2,4,8]"})
    """Batch-size buckets (ascending); default 1, 2, 4, 8, 16, 24, 32, ... 256."""


@dataclass(frozen=True)
class ExtendGraphConfig:
    enabled: Any = Switch.auto
    """auto | on | off: full CUDA graphs for extend and mixed steps of up to the largest size whose logits rows fit
    those a bucket computes (each sequence's last, or every token's of some sequences up to min(t, max_seqs) rows)
    (CUDA only; where the kernel table has backends safe there: attention.triton_all on bf16 / fp16 KV pools, for
    models without sliding windows or soft caps; no MLA). auto: on one GPU; on: under tensor parallelism too."""
    sizes: Optional[list[int]] = field(default=None, metadata={"example": "[16,64,256]"})
    """Token buckets (ascending); default 16, 32, 64, 128, 256, 512. A step goes to the smallest that holds it,
    unless the piecewise graphs would pad it less (then it runs piecewise)."""
    max_seqs: int = 64
    """Most sequences in one such step, and most logits rows a bucket computes; steps with more run piecewise."""


@dataclass(frozen=True)
class CudaGraphConfig:
    piecewise: PiecewiseConfig = field(default_factory=PiecewiseConfig)
    decode: DecodeGraphConfig = field(default_factory=DecodeGraphConfig)
    extend: ExtendGraphConfig = field(default_factory=ExtendGraphConfig)


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:N."""
    dtype: str = "auto"
    """auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32."""
    seed: int = 0
    """Seed of the random weights, the random prompts and the sampler's shared generator; an integer
    in [-2**63, 2**64 - 1] (what torch.Generator.manual_seed accepts)."""
    pdl: Any = Switch.auto
    """auto | on | off: programmatic dependent launch of pieceworks' Triton kernels, so each is
    launched while the kernel before it finishes (and waits for it on the GPU). auto: on
    where supported (CUDA compute capability >= 9.0 and a triton with grid dependency control); on:
    the same, an error elsewhere. Process-wide: the last executor built decides (backends/pdl.py)."""
    cache_dir: Optional[str] = None
    """Where pieceworks keeps what it builds once: the converted demo models (<cache_dir>/models) and
    compiled CUDA kernels (<cache_dir>/nvrtc). null: `cache_root()`'s default,
    $XDG_CACHE_HOME/pieceworks (when absolute) or ~/.cache/pieceworks."""
    kernel_cache: bool = True
    """Keep NVRTC-compiled CUDA kernels in <cache_dir>/nvrtc for the next process (backends/nvrtc.py);
    false: compile them in every process. Process-wide: the last executor built decides."""


def cache_root(cache_dir: str | None = None) -> Path:
    """`runtime.cache_dir`, or where it defaults to: `pieceworks` under the user's cache directory
    ($XDG_CACHE_HOME when it is an absolute path, else ~/.cache; `pieceworks.environment`). Modules
    take the directory from here or from their caller."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    return user_cache_home() / "pieceworks"


@dataclass(frozen=True)
class ParallelConfig:
    """Several processes, one shard of the model each (torch.distributed: NCCL on CUDA, gloo on CPU)."""

    tensor_parallel_size: int = 1
    """Ranks the model is split over (attention heads, MLP columns, vocabulary). 1: one process, no
    collectives. N > 1: under `torchrun --nproc-per-node N` every rank builds its shard; otherwise
    `Executor.from_config` starts N - 1 worker processes itself. On CUDA rank r uses GPU r."""
    expert_parallel: bool = False
    """MoE models: give each rank whole routed experts (n_routed_experts / N of them) instead of a 1/N
    slice of every expert; the ranks' outputs are summed by the same all-reduce."""
    timeout_s: float = 300.0
    """How long a rank waits in a collective, or the leader for a follower to take a step message off
    the shared-memory queue, before it gives up (followers wait for the next step as long as the
    leader lives); a worker that dies is reported at the next step (or when a collective fails) with
    its exit code. At most 1,000,000 s."""


@dataclass(frozen=True)
class PluginsConfig:
    disabled: list[str] = field(default_factory=list, metadata={"example": "[pieceworks.flashinfer]"})
    """Plugin names to block (entry-point names, or built-in families such as pieceworks.flashinfer)."""
    autoload: bool = True
    """Load third-party backends from the `pieceworks` entry-point group."""


@dataclass(frozen=True)
class SchedulerConfig:
    """How the Engine (pieceworks.engine) batches requests into steps."""

    max_num_seqs: int = 256
    """Most sequences in one step (running decodes plus prefill chunks)."""
    policy: Policy = Policy.fcfs
    """fcfs: waiting requests are admitted in arrival order, and a preemption takes the latest admitted.
    priority (vLLM's): `add_request(..., priority=p)`, lower p first: waiting requests in (priority,
    arrival) order, and a preemption takes the running request of the highest (priority, arrival)."""
    max_num_batched_tokens: Optional[int] = None
    """Most new tokens in one step; longer prompts are prefilled in chunks alongside running decodes.
    When unset: 8192 on a GPU of at least 70 GiB, else 2048 (as vLLM's server and SGLang default on
    H100/H200-class GPUs). A step reads every weight once (NVFP4 steps above 1,024 rows also dequantize
    it), so a burst of prompts prefills at less cost per token in fewer, fuller steps; but running
    decodes wait longer behind such a step, and the first prompt of a burst waits for all of its step
    (docs/benchmarks.md, "Serving through the Engine": both budgets measured). Steps above
    cuda_graph.piecewise.max_tokens run eagerly."""
    watermark: float = 0.01
    """Fraction of the KV pool kept free when admitting a new request, so running requests can grow a
    while before one has to be preempted (ignored when nothing runs)."""
    async_steps: bool = True
    """Keep one step in flight: launch step k (its decode rows read their input ids from step k - 1's sampled ids on
    the device), then wait for step k - 1's ids and return its outputs, so the host work of one step overlaps
    the GPU work of the previous one. Applies to every step (decodes and prompt chunks; greedy or sampled rows,
    with penalties, logprobs, min_tokens or stop strings) that needs no preemption, at world size 1; a step whose rows
    give prompt logprobs waits for its own forward to read them on the host, and the pipeline goes on. A step that
    preempts first drains the one in flight (that `step` call returns its outputs only) and then runs synchronously,
    as every step of a distributed run does. The step that starts the pipeline returns no outputs of its own. On by
    default: on the H200 it adds 15% output tok/s to the 64-request serving benchmark (docs/benchmarks.md); greedy
    tokens are the same as with synchronous steps (tests/gpu/test_engine_gpu.py)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding in the Engine (docs/sampling.md, "Speculative decoding")."""

    method: Optional[str] = None
    """None: off. ngram (vLLM's prompt lookup): a decode row's drafts are the tokens that followed the last earlier
    occurrence of its longest trailing n-gram in prompt + output; one step checks them all (greedy and sampled rows
    without penalties, a grammar or prompt logprobs). Steps that may draft run synchronously (the drafts follow the
    last step's tokens); see max_batch."""
    num_speculative_tokens: int = 3
    """Most draft tokens per row and step (1..64)."""
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    """The longest and shortest trailing n-gram looked up (the longest that occurred before wins; 1..32)."""
    max_batch: Optional[int] = 4
    """Draft only while at most this many requests run; above, steps run without drafts, asynchronously where
    scheduler.async_steps allows. A verify step feeds k + 1 tokens per drafting row, which a large batch pays for
    in compute where a small one rides on the weights' reads: on an H100 (Llama-3.1-8B shape, NVFP4) drafts of
    which 30% are accepted pay up to 4 requests, 65% up to 32 (docs/sampling.md). None: at every batch size."""


@dataclass(frozen=True)
class GenerationConfig:
    """What `pieceworks run` generates, and how `pieceworks chat` samples its answers where its flags don't say
    (the Python API takes these as arguments instead). Unset: the command's own default."""

    prompts: list[str] = field(default_factory=list, metadata={"example": '["Hi","Hello"]'})
    """`pieceworks run`'s prompts (default: a few sample questions)."""
    max_new_tokens: Optional[int] = None
    """New tokens per prompt or answer; unset: 32 for `run`, the rest of the context for `chat`."""
    temperature: Optional[float] = None
    """Unset: 0 (greedy) for `run`, 0.7 for `chat`."""
    top_p: Optional[float] = None
    """Unset: 1.0 for `run`, 0.9 for `chat`."""
    chat_template: bool = True
    """`pieceworks run` wraps each prompt in the model's chat template (false: the raw text)."""

    def settings(self, max_new_tokens: int | None, temperature: float, top_p: float) -> tuple:
        """(max_new_tokens, temperature, top_p): the values set here, else the given defaults."""
        pick = lambda value, default: default if value is None else value  # noqa: E731
        return (pick(self.max_new_tokens, max_new_tokens), pick(self.temperature, temperature),
                pick(self.top_p, top_p))


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"example": "{arch: llama}"})
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    backends: BackendsConfig = field(default_factory=BackendsConfig)
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)


def load_config(
    source: str | os.PathLike | dict | Config | None = None,
    overrides: list[str] | None = None,
    *,
    require_model: bool = True,
) -> Config:
    """Build a validated, frozen Config.

    Args:
        source: a YAML file path, a dict, an existing Config, or None (defaults).
        overrides: dotlist strings such as ["model.path=/models/x", "backends.mla=flashinfer"].
        require_model: a model (path or arch) must be named (False for `pieceworks backends`).

    Raises:
        ConfigError: unknown key, wrong type or invalid value (message names the key and the value).
    """
    if isinstance(source, Config):
        source = as_dict(source)
    elif source is not None and not isinstance(source, dict):
        if not isinstance(source, (str, os.PathLike)):
            raise ConfigError(f"config: a YAML path, a dict, a Config or None, not {type(source).__name__}"
                              + (" (overrides go in the second argument)" if isinstance(source, list) else ""))
        source = Path(source)
    if overrides is not None:
        listed = None if isinstance(overrides, (str, bytes)) else list(overrides)
        if listed is None or not all(isinstance(o, str) for o in listed):
            raise ConfigError(f"overrides: a list of 'key=value' strings, not {overrides!r}")
        overrides = listed
    obj = merge(Config, source, overrides)
    try:
        cfg = _normalize(plain(obj))
        validate(cfg, require_model)
    except ConfigError as exc:
        raise with_location(exc, source if isinstance(source, Path) else None) from None
    return cfg


def _switch(key: str, value: Any) -> Switch:
    # YAML 1.1 (and so OmegaConf's dotlist parsing) reads on/off/yes/no as booleans
    if isinstance(value, bool):
        return Switch.on if value else Switch.off
    try:
        return Switch(value.value if isinstance(value, Switch) else value)
    except (ValueError, AttributeError):
        raise ConfigError(f"{key}: {value!r} is not allowed; use auto, on or off") from None


def _normalize(cfg: Config) -> Config:
    g = cfg.cuda_graph
    pw = replace(g.piecewise, enabled=_switch("cuda_graph.piecewise.enabled", g.piecewise.enabled))
    dec = replace(g.decode, enabled=_switch("cuda_graph.decode.enabled", g.decode.enabled))
    ext = replace(g.extend, enabled=_switch("cuda_graph.extend.enabled", g.extend.enabled))
    runtime = replace(cfg.runtime, pdl=_switch("runtime.pdl", cfg.runtime.pdl))
    return replace(cfg, cuda_graph=replace(g, piecewise=pw, decode=dec, extend=ext), runtime=runtime)


__all__ = ["Config", "ConfigError", "Switch", "load_config", "to_yaml", "asdict"]
