"""What the CLI prints: the backend registry and kernel table, the main job, perplexity."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pieceworks.backends.base import BackendSpec, ModelFacts
from pieceworks.backends.registry import KernelTable, Registry, load_registry
from pieceworks.config import Config, Switch
from pieceworks.core.batch import TABLE_MODES, ForwardMode, GraphMode
from pieceworks.executor.scheduler import StepStats
from pieceworks.util import progress_bar

console = Console()


def _fmt_modes(modes: Any) -> str:
    names = sorted(m.value for m in modes)
    return "all" if len(names) >= 3 else ",".join(names)


def _model_facts(cfg: Config) -> tuple[ModelFacts, list[str] | None]:
    """Facts of the configured model without loading weights; generic facts (all ops) otherwise."""
    if cfg.model.path or cfg.model.arch:
        from dataclasses import replace

        from pieceworks.models.demo import resolve_model_path
        from pieceworks.models.loader import model_facts

        from pieceworks.executor.build import wants_fp8_kv
        from pieceworks.quant.modelopt import detect_quantization

        model = replace(cfg.model, path=str(resolve_model_path(cfg.model.path))) if cfg.model.path else cfg.model
        facts, ops = model_facts(model, cfg.quantization, cfg.kv_cache.page_size)
        quant = detect_quantization(model.path) if model.path else None
        asks = quant is not None and quant.kv_cache_quant_algo == "FP8"
        return replace(facts, kv_fp8=wants_fp8_kv(cfg.kv_cache.dtype, asks, facts.kv_lora_rank > 0)), sorted(ops)
    return ModelFacts(fp4=True, moe_experts=8, moe_quant="nvfp4", kv_lora_rank=512, qk_rope_head_dim=64,
                      page_size=cfg.kv_cache.page_size), None


def print_backends(cfg: Config) -> int:
    """`pieceworks backends`: every backend and why it can or can't serve here, then the table."""
    from pieceworks.core.devices import resolve_device

    registry = load_registry(cfg.plugins)
    device = resolve_device(cfg.runtime.device)
    facts, ops = _model_facts(cfg)
    spec = BackendSpec.for_device(device, model=facts, fp4_numerics=cfg.quantization.fp4_numerics)
    cap = f" (compute capability {spec.capability[0]}.{spec.capability[1]})" if spec.capability else ""
    # A SelectionError (a backend that isn't registered or can't serve here, with the reasons) propagates before
    # anything is printed: the CLI prints it on stderr as one line and exits 2.
    table = registry.resolve(cfg.backends, spec, ops or ("attention", "mla", "fp4_gemm", "moe"))
    console.print(f"[bold]device[/bold]: {device}{cap}; plugins: {', '.join(registry.plugin_names())}")

    print_registered(registry, spec)
    for broken in registry.broken:
        console.print("[red]broken plugin[/red] " + escape(f"{broken.name} ({broken.origin}): {broken.reason}; "
                                                           f"block it with plugins.disabled=[{broken.name}]"))
    print_kernel_table(table)
    print_graph_config(cfg, device, table=table)
    return 0


def print_registered(registry: Registry, spec: BackendSpec) -> None:
    """The registered backends, one row each, then why each one that can't serve here can't. The reasons
    sit below the table, one per line, wrapped under the backend's name: a column of them would leave
    them a few characters wide in an 80-column terminal."""
    t = Table(title="registered backends")
    for col in ("op", "backend", "prio", "modes", "graphs", "numerics", "serves here"):
        t.add_column(col, overflow="fold")
    refused = []
    for cls in registry.backends():
        reasons = registry.reasons(cls, spec)
        t.add_row(cls.op, cls.name, str(cls.priority), _fmt_modes(cls.forward_modes),
                  _fmt_modes(cls.graph_modes), "/".join(cls.numerics) or "-",
                  "[green]yes[/green]" if not reasons else "[red]no[/red]")
        if reasons:
            refused.append((f"{cls.op}.{cls.name}", reasons))
    console.print(t)
    if refused:
        why = Table.grid(padding=(0, 2))
        why.add_column(no_wrap=True)
        why.add_column(overflow="fold")
        for name, reasons in refused:
            why.add_row(f"[red]{escape(name)}[/red]", "\n".join(escape(r) for r in reasons))
        console.print("[bold]why not here[/bold]:")
        console.print(why)


def print_kernel_table(table: KernelTable) -> None:
    t = Table(title="kernel table (op x forward mode x graph mode)")
    for col in ("op", "mode", "graph", "backend", "configured", "note"):
        t.add_column(col, overflow="fold")
    for d in table.decisions:
        note = f"fallback from {d.fallback_from}: {d.note}" if d.fallback_from else d.note
        t.add_row(d.op, d.forward_mode.value, d.graph_mode.value, d.chosen or "-", d.configured, escape(note))
    console.print(t)


def print_graph_config(cfg: Config, device: torch.device, ex: Any = None, table: KernelTable | None = None) -> None:
    """The graph setup: from the config, and where a kernel table is given (or the executor's), off for a
    graph mode in which no backend is safe (those steps run eagerly)."""
    from pieceworks.executor.cuda_graph import default_batch_sizes
    from pieceworks.executor.piecewise import default_sizes

    table = table if table is not None else (ex.table if ex is not None else None)
    unsafe = table.graph_unavailable if table is not None else {}
    pw, dec = cfg.cuda_graph.piecewise, cfg.cuda_graph.decode
    cuda = device.type == "cuda"
    pw_why = unsafe.get((ForwardMode.EXTEND, GraphMode.PIECEWISE))
    dec_why = unsafe.get((ForwardMode.DECODE, GraphMode.FULL))
    pw_wanted = pw.enabled is Switch.on or (pw.enabled is Switch.auto and cuda)
    dec_wanted = cuda and dec.enabled is not Switch.off
    pw_on, dec_on = pw_wanted and pw_why is None, dec_wanted and dec_why is None
    sizes = pw.sizes or default_sizes(pw.max_tokens)
    bss = dec.batch_sizes or default_batch_sizes()
    what = "CUDA graphs" if cuda else "traced and split, run without graphs (CPU)"
    mixed_why = unsafe.get((ForwardMode.MIXED, GraphMode.PIECEWISE))
    console.print(
        f"[bold]piecewise[/bold] (extend/mixed): {'on' if pw_on else 'off'}"
        + (f", {what}, max_tokens {pw.max_tokens}, {len(sizes)} sizes {_span(sizes)}" if pw_on else "")
        + (escape(f" (no backend safe in piecewise graphs: {pw_why}; extend and mixed steps run eagerly)")
           if pw_wanted and pw_why else "")
        + (escape(f"; mixed steps run eagerly ({mixed_why})") if pw_on and mixed_why else "")
    )
    console.print(f"[bold]decode graphs[/bold]: {'on' if dec_on else 'off'}"
                  + (f", {len(bss)} batch sizes {_span(bss)}" if dec_on else " (need CUDA)" if not cuda else "")
                  + (escape(f" (no backend safe in full graphs: {dec_why}; decode steps run eagerly)")
                     if dec_wanted and dec_why else ""))
    console.print("[bold]extend graphs[/bold] (full, extend/mixed): " + escape(_extend_graphs(cfg, cuda, table, ex)))
    from pieceworks.backends import pdl

    mode = pdl.mode_name(cfg.runtime.pdl)
    why = pdl.unsupported_reason(device) if mode != "off" else None
    console.print(f"[bold]programmatic dependent launch[/bold] (runtime.pdl={mode}): "
                  + ("on" if mode != "off" and why is None else "off" + (f" ({why})" if why else "")))
    if ex is not None:
        for name, runner in (("piecewise", ex.piecewise), ("decode", ex.decode_graphs)):
            if runner is not None:
                d = runner.describe()
                parts = [f"{k}={_num(v)}" for k, v in d.items() if k not in ("sizes", "batch_sizes")]
                console.print(f"  {name} capture: " + ", ".join(parts))


def _extend_graphs(cfg: Config, cuda: bool, table: KernelTable | None, ex: Any) -> str:
    """`cuda_graph.extend` as the executor builds it (`executor.build.extend_graph_runner`): on, with its buckets, or
    off and why."""
    from pieceworks.executor import extend_graph

    ext = cfg.cuda_graph.extend
    runner = getattr(ex, "extend_graphs", None) if ex is not None else None
    if runner is not None:
        return f"on, {len(runner.sizes)} token buckets {_span(runner.sizes)}, up to {runner.max_seqs} sequences"
    if ext.enabled is Switch.off:
        return "off"
    why = extend_graph.why_off(ext, cuda, cfg.parallel.tensor_parallel_size > 1, table)
    if why is not None:
        return f"off ({why})"
    if ex is not None:  # built, and still none: the executor said why when it was built
        return "off"
    sizes = list(ext.sizes) if ext.sizes else extend_graph.default_sizes(10**9)
    return f"on, {len(sizes)} token buckets {_span(sizes)} (up to max_context), up to {ext.max_seqs} sequences"


def _span(xs: list[int]) -> str:
    return f"[{', '.join(map(str, xs[:4]))}, ..., {xs[-1]}]" if len(xs) > 5 else str(xs)


def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, int) and v > 1 << 20:
        return f"{v / 2**30:.2f} GiB"
    return str(v)


def run_main_job(cfg: Config) -> int:
    """`pieceworks run`: build, generate for the prompts, print text, speed and the backend table."""
    from pieceworks.executor.runner import Executor

    t0 = time.perf_counter()
    # closed on the way out: under torchrun the other ranks follow this one's steps until it closes
    with Executor.from_config(cfg) as ex:
        return _main_job(ex, cfg, time.perf_counter() - t0)


@dataclass
class _ShownSteps(StepStats):
    """StepStats that advance a progress bar at every step."""

    advance: Callable[[], None] = lambda: None

    def add(self, mode: ForwardMode, num_tokens: int, seconds: float) -> None:
        super().add(mode, num_tokens, seconds)
        self.advance()


def _main_job(ex: Any, cfg: Config, build_s: float) -> int:
    tok = _tokenizer_for(ex, cfg)
    max_new, temperature, top_p = cfg.generation.settings(*RUN_GENERATION)
    if tok is not None:
        texts = list(cfg.generation.prompts) or DEFAULT_PROMPTS
        prompts = [encode_prompt(tok, p, cfg.generation.chat_template) for p in texts]
        stop = _stop_ids(tok)
    else:  # random weights have no tokenizer: random prompts, token ids out
        gen = torch.Generator().manual_seed(cfg.runtime.seed)
        room = ex.max_context - max_new  # prompts that fit a small model's context
        lengths = sorted({max(1, min(n, room)) for n in (16, 64, 256)})
        prompts = [torch.randint(0, ex.vocab_size, (n,), generator=gen).tolist() for n in lengths]
        texts = [f"{len(p)} random token ids" for p in prompts]
        stop = []
    t1 = time.perf_counter()
    # a bar of steps on a terminal (a slow machine's generate runs for many seconds); about one step per token
    with progress_bar(console.is_terminal, "generating (steps)", total=max_new) as advance:
        stats = _ShownSteps(advance=advance)
        outs = ex.generate(prompts, max_new, temperature=temperature, top_p=top_p, stop_token_ids=stop, stats=stats)
    gen_s = time.perf_counter() - t1
    for text, out in zip(texts, outs):
        console.print(f"[bold cyan]> {escape(text)}[/bold cyan]")
        console.print(escape(tok.decode(out, skip_special_tokens=True).strip() if tok else str(out)))
    n_new = sum(map(len, outs))
    console.print(
        f"\n[bold]{cfg.model.path or cfg.model.arch}[/bold] on {ex.device} ({ex.model.dtype}; KV cache "
        f"{ex.kv.num_tokens} tokens of {str(ex.kv.dtype).removeprefix('torch.')}): built in "
        f"{build_s:.1f} s; {n_new} tokens in {gen_s:.2f} s = {n_new / gen_s:.1f} tokens/s"
    )
    console.print(stats.summary())
    if cfg.speculative.method is not None:
        console.print(f"speculative.method={cfg.speculative.method} applies to the Engine (pieceworks serve, "
                      "pieceworks chat, pieceworks.Engine); pieceworks run generates through Executor.generate, "
                      "without it")
    print_kernel_table_compact(ex.table)
    print_graph_config(cfg, ex.device, ex)
    return 0


def _tokenizer_for(ex: Any, cfg: Config) -> Any:
    """The model's tokenizer, or None when it has none (random weights, a directory without tokenizer
    files) and no prompts are given: `run` then generates from random token ids.

    Raises:
        ConfigError: generation.prompts are given for a model without a tokenizer.
        TokenizerError: its tokenizer files are there but don't load.
    """
    from pieceworks.errors import CheckpointError, ConfigError, TokenizerError

    try:
        return ex.tokenizer
    except TokenizerError:
        raise
    except CheckpointError as e:
        if cfg.generation.prompts:
            raise ConfigError(f"generation.prompts: given, but {e}") from None
        return None


def print_kernel_table_compact(table: KernelTable) -> None:
    ops = sorted({op for (op, _, _), b in table.entries.items() if b is not None})
    t = Table(title="backends in use")
    for col in ("mode / graph", *ops):
        t.add_column(col)
    for m, gs in TABLE_MODES.items():
        for g in gs:
            cells = [(table.get(op, m, g).name if table.get(op, m, g) is not None else "-") for op in ops]
            t.add_row(f"{m.value} / {g.value}", *cells)
    console.print(t)


RUN_GENERATION = (32, 0.0, 1.0)  # `pieceworks run`'s max_new_tokens, temperature, top_p where generation.* is unset
DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a GPU is.",
]


def encode_prompt(tok: Any, text: str, chat: bool) -> list[int]:
    """`text` as a user turn of the model's chat template (`chat` and the model has one), else as is.

    Raises:
        RequestError: the chat template fails while rendering (see `render_chat`).
    """
    if chat and getattr(tok, "chat_template", None):
        from pieceworks.models.tokenizer import render_chat

        return render_chat(tok, [{"role": "user", "content": text}],
                           hint="run with generation.chat_template=false to encode the prompts without it")
    return tok.encode(text)


def _stop_ids(tok: Any) -> list[int]:
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        i = tok.convert_tokens_to_ids(name)
        if isinstance(i, int) and i != tok.unk_token_id and i is not None:
            ids.add(i)
    return sorted(ids)


def eval_perplexity(cfg: Config, text_path: Path, window: int | None) -> int:
    """`pieceworks eval-ppl`: perplexity over non-overlapping windows of `window` tokens (None: 512, or the
    model's context where shorter; see models/ppl.py).

    Raises:
        ConfigError: random weights (model.arch): no tokenizer for the text; before anything loads.
        ValueError: a window longer than the model's context, or a text of fewer than 2 tokens (the executor is
            closed again)."""
    from pieceworks.errors import ConfigError
    from pieceworks.executor.runner import Executor
    from pieceworks.models.ppl import DEFAULT_WINDOW, perplexity_from_logits, windows

    if cfg.model.path is None:
        raise ConfigError("eval-ppl scores a text, which needs the model's tokenizer: model.arch builds random "
                          "weights without one; give model.path (a model directory with its tokenizer files)")
    text = text_path.read_text(encoding="utf-8")  # the CLI has checked the file
    if not text.strip():
        raise ValueError(f"--text {text_path}: empty (or only whitespace); give a text to score")
    with Executor.from_config(cfg) as ex:
        if window is None:
            window = min(DEFAULT_WINDOW, ex.max_context)
        elif window > ex.max_context:
            raise ValueError(f"--window {window} exceeds the model's context of {ex.max_context} tokens; "
                             f"use --window {ex.max_context} or less")
        # the windows split the text: transformers' warning about a sequence longer than the model's is moot
        ids = ex.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) < 2:
            raise ValueError(f"--text {text_path}: {len(ids)} token(s); perplexity needs at least 2 (one of "
                             "context, one scored): give a longer text")
        chunks = windows(ids, window)
        t0 = time.perf_counter()
        logits = []
        with progress_bar(console.is_terminal, "scoring windows", total=len(chunks)) as advance:
            for chunk in chunks:
                logits.extend(ex.score([chunk]))
                advance()
        ppl, n = perplexity_from_logits(logits, chunks)
    console.print(f"perplexity {ppl:.4f} over {n} scored tokens ({len(chunks)} windows of <= {window}); "
                  f"{time.perf_counter() - t0:.1f} s")
    return 0
