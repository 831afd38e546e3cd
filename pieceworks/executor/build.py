"""Building an Executor: the model, its kernel table, the KV pool and the graph runners, in that order
(and releasing them: `release_executor`, behind `Executor.close`).

`Executor.from_config`, `Executor.resolve_model_dir` and `Executor.build` call `executor_from_config`,
`model_dir_of` and `build_executor`. The executor class comes in as an argument (`cls`), so this
module stands below `runner.py`, where the step reads alone. The configuration is checked (`load_config`,
`runtime.pdl`) before any weight is read; an error at a later stage raises before the executor exists,
so no half-built one is returned."""

from __future__ import annotations

import gc
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pieceworks.backends import nvrtc, pdl
from pieceworks.backends.base import BackendSpec
from pieceworks.backends.registry import load_registry
from pieceworks.config import Config, ConfigError, Switch, cache_root, load_config
from pieceworks.core.batch import ForwardMode, GraphMode
from pieceworks.core.devices import resolve_device, resolve_dtype
from pieceworks.core.kv import KV_FP8
from pieceworks.errors import CheckpointError
from pieceworks.executor.kv_cache import KVPool

log = logging.getLogger("pieceworks.executor")


def executor_from_config(cls: type, cfg: Any, overrides: list[str] | None, progress: bool) -> Any:
    """`Executor.from_config`: one process's executor, or the leader of a tensor-parallel run."""
    cfg = load_config(cfg, overrides)  # a Config too: one made or replaced in code is checked as a YAML one is
    if cfg.parallel.tensor_parallel_size > 1:
        from pieceworks.executor.distributed import launch

        return launch(cls, cfg, progress)
    return cls.build(cfg, progress, resolve_device(cfg.runtime.device), cls.resolve_model_dir(cfg, progress))


def model_dir_of(cfg: Config, progress: bool) -> Path | None:
    """The model directory of model.path (a bundled demo model is converted into the cache first)."""
    if not cfg.model.path:
        return None
    from pieceworks.models.demo import resolve_model_path

    return resolve_model_path(cfg.model.path, progress=progress, cache_dir=cache_root(cfg.runtime.cache_dir) / "models")


def build_executor(cls: type, cfg: Config, progress: bool, device: torch.device, model_dir: Path | None,
          groups: Any = None) -> Any:
    """`Executor.build`: one rank's executor (`cls`) on `device`, of the model in `model_dir` (or
    model.arch's): the whole model, or with `groups` (`parallel.group.ProcessGroups`) that rank's shard."""
    from pieceworks.models.demo import DEMO_MODELS, demo_model_damaged
    from pieceworks.models.loader import load_model
    from pieceworks.parallel.layout import TPLayout

    dtype = resolve_dtype(cfg.runtime.dtype, device)
    pdl_mode = pdl.mode_name(cfg.runtime.pdl)
    if pdl_mode == "on" and (reason := pdl.unsupported_reason(device)) is not None:
        raise ConfigError(f"runtime.pdl: on, but {reason}; use runtime.pdl=auto or off")
    registry = load_registry(cfg.plugins)
    nvrtc.configure_cache(cache_root(cfg.runtime.cache_dir) / "nvrtc" if cfg.runtime.kernel_cache else None)
    model_cfg = replace(cfg.model, path=str(model_dir)) if model_dir else cfg.model
    tp = TPLayout()
    if groups is not None:
        tp = TPLayout(groups.rank, groups.size, groups.device_group, cfg.parallel.expert_parallel)
    # random weights come from a private generator seeded with runtime.seed: the process-wide
    # torch RNG is the caller's
    try:
        model = load_model(model_cfg, cfg.quantization, device, dtype, progress=progress,
                           seed=cfg.runtime.seed, tp=tp)
    except CheckpointError as exc:
        if model_dir is None or cfg.model.path not in DEMO_MODELS:
            raise
        raise demo_model_damaged(exc, model_dir) from None
    kv_dtype = kv_cache_dtype(cfg.kv_cache.dtype, model)
    facts = model.facts(cfg.kv_cache.page_size)
    spec = BackendSpec.for_device(device, model=replace(facts, kv_fp8=kv_dtype == KV_FP8),
                                  fp4_numerics=cfg.quantization.fp4_numerics)
    table = registry.resolve(cfg.backends, spec, model.required_ops())
    model.prepare(table)
    scales = model.kv_scales if kv_dtype == KV_FP8 else None
    kv = KVPool.sized(model.kv_layout(), cfg.kv_cache.page_size, kv_dtype, device,
                      cfg.kv_cache.num_tokens, cfg.kv_cache.memory_fraction, cfg.kv_cache.prefix_caching, scales)
    if groups is not None:  # every rank's pool has the leader's page ids: the smallest pool wins
        num_pages = groups.min_int(kv.allocator.num_pages)
        if num_pages < kv.allocator.num_pages:
            kv = None  # the larger pool goes before the smaller one is allocated
            kv = KVPool(model.kv_layout(), num_pages, cfg.kv_cache.page_size, kv_dtype, device,
                        cfg.kv_cache.prefix_caching, scales)
    ex = cls(cfg, model, table, kv, device, model_dir)
    ex.groups = groups
    pdl.configure(pdl_mode, device)  # before the graphs capture the kernels
    try:
        ex.piecewise, ex.decode_graphs = graph_runners(cfg.cuda_graph, model, table, kv, ex.max_context, progress)
        ex.extend_graphs = extend_graph_runner(cfg.cuda_graph.extend, model, table, kv, ex.max_context, progress,
                                               groups is not None and groups.size > 1)
    except BaseException:  # torch.compile's caches would keep the model and the KV pool for the process's life
        release_executor(ex, "this executor's build failed; build a new executor")
        raise
    return ex


def extend_graph_runner(ext: Any, model: torch.nn.Module, table: Any, kv: KVPool, max_context: int,
                        progress: bool, tensor_parallel: bool = False) -> Any:
    """ExtendGraphRunner for `cuda_graph.extend` (CUDA only), or None: off; auto under tensor parallelism (not
    run on several GPUs yet); no CUDA; or no backend safe in full graphs of extend steps (said at warning level
    where the config switched it on, else at info level)."""
    if ext.enabled is Switch.off:
        return None
    from pieceworks.executor import extend_graph

    sizes = list(ext.sizes) if ext.sizes else extend_graph.default_sizes(max_context)
    why = extend_graph.why_off(ext, kv.device.type == "cuda", tensor_parallel, table)
    if why is not None:
        (log.warning if ext.enabled is Switch.on else log.info)("cuda_graph.extend: %s; extend and mixed steps run "
                                                                "in piecewise graphs where they are on, else eagerly",
                                                                why)
        return None
    return extend_graph.ExtendGraphRunner(model, table, kv, max_context, sizes, ext.max_seqs, progress)


def wants_fp8_kv(setting: str, checkpoint_fp8: bool, mla: bool) -> bool:
    """Whether `kv_cache.dtype` = `setting` makes an FP8 pool for a checkpoint that asks for one (or not), of an MLA
    model (or a GQA one): see `kv_cache_dtype`."""
    return setting == "fp8" or (setting == "auto" and checkpoint_fp8 and not mla)


def kv_cache_dtype(setting: str, model: Any) -> torch.dtype:
    """The KV pool's dtype for `kv_cache.dtype` = `setting`: the model's (model), e4m3 (fp8), or (auto) e4m3 where
    the checkpoint asks for it and the model's otherwise. An MLA model keeps its latents in the model dtype under
    auto, with a warning where the checkpoint asked for FP8 (no MLA backend reads FP8 latents); fp8 named for it
    is refused by every MLA backend at selection."""
    if wants_fp8_kv(setting, model.kv_cache_quant == "fp8", model.kv_layout().kind == "mla"):
        if model.kv_cache_quant == "fp8" and model.kv_scales is None:
            log.warning("the checkpoint asks for an FP8 KV cache but holds no k_scale / v_scale: scales of 1.0")
        elif model.kv_scales is None:
            log.info("kv_cache.dtype=fp8 without checkpoint scales: K/V stored as e4m3 with scales of 1.0")
        return KV_FP8
    if setting == "auto" and model.kv_cache_quant == "fp8":
        log.warning("the checkpoint asks for an FP8 KV cache; no MLA backend reads FP8 latents, so they stay in "
                    "%s (kv_cache.dtype=model silences this)", str(model.dtype).removeprefix("torch."))
    return model.dtype


def graph_runners(graphs_cfg: Any, model: torch.nn.Module, table: Any, kv: KVPool, max_context: int,
                  progress: bool) -> tuple[Any, Any]:
    """(PiecewiseRunner or None, DecodeGraphRunner or None) for `graphs_cfg` (a CudaGraphConfig) and the
    pool's device: piecewise graphs for extend and mixed steps (on CUDA by default; on the CPU the same
    split runs directly when switched on) and full decode graphs (CUDA only). Neither where the kernel
    table has no backend safe in that graph mode (`KernelTable.graph_unavailable`): those steps run
    eagerly, with a warning when the config switched the graphs on."""
    on_cuda = kv.device.type == "cuda"
    piecewise = decode_graphs = None
    dec = graphs_cfg.decode
    if dec.enabled is not Switch.off:  # before any graph work
        from pieceworks.executor.cuda_graph import check_batch_sizes

        check_batch_sizes(dec.batch_sizes, kv.allocator.capacity, kv.page_size)
    pw = graphs_cfg.piecewise
    if (pw.enabled is Switch.on or (pw.enabled is Switch.auto and on_cuda)) and graphs_possible(
            table, ForwardMode.EXTEND, GraphMode.PIECEWISE, pw.enabled, "cuda_graph.piecewise"):
        from pieceworks.executor.piecewise import PiecewiseRunner

        piecewise = PiecewiseRunner(model, table, kv, pw, max_context, progress=progress)
    try:
        if on_cuda and dec.enabled is not Switch.off and graphs_possible(
                table, ForwardMode.DECODE, GraphMode.FULL, dec.enabled, "cuda_graph.decode"):
            from pieceworks.executor.cuda_graph import DecodeGraphRunner

            decode_graphs = DecodeGraphRunner(model, table, kv, max_context, dec.batch_sizes, progress=progress)
        elif dec.enabled is Switch.on:
            log.info("cuda_graph.decode.enabled=on has no effect on %s: decode graphs need CUDA", kv.device)
    except BaseException:
        if piecewise is not None:
            piecewise.release()
        raise
    return piecewise, decode_graphs


def graphs_possible(table: Any, mode: ForwardMode, graph: GraphMode, switch: Switch, key: str) -> bool:
    """Whether `table` has a backend for every op of `mode` steps under `graph`; if not, says so (a warning
    where `key.enabled` is on, else at info level) and the runner is not built."""
    why = table.graph_unavailable.get((mode, graph))
    if why is None:
        return True
    (log.warning if switch is Switch.on else log.info)(
        "%s: no backend is safe in %s graphs for %s steps (%s); those steps run eagerly",
        key, graph.value, mode.value, why)
    return False


def release_executor(ex: Any, message: str) -> None:
    """`Executor.close`: drop the graph runners, the model, the KV pool and the kernel table (the last
    three replaced by stand-ins whose every use raises RuntimeError(`message`)), then free their memory."""
    if ex.piecewise is not None:
        ex.piecewise.release()
    ex.piecewise = ex.decode_graphs = ex.extend_graphs = ex.greedy_ids = None
    ex.model = ex.kv = ex.table = _Closed(message)
    ex._live.clear()
    gc.collect()  # the graph runners and backends hold reference cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _Closed:
    """Stands for the model, KV pool and kernel table of a closed executor: any use raises a
    RuntimeError with `message`."""

    def __init__(self, message: str) -> None:
        self._message = message

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(self._message)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(self._message)
