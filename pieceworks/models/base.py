"""The model contract the executor relies on, and the layers Llama and DeepSeek-V3 share.

A model is a `CausalLM`: `forward(input_ids [T], positions [T]) -> hidden [T, H]` over the flat token
layout of one step (every per-step fact, the KV cache included, comes from the forward context through
the attention ops). Model code calls kernels only through the `pieceworks` custom ops (the wrappers in
`backends/ops.py` and `backends/fused.py`, which leave out the dispatcher in eager code: core/direct.py),
keeps per-layer Python state to ints, and has no per-layer branches, so Dynamo traces it with `fullgraph=True` and
identical layers give identical pieces.

Shape legend: T tokens in the step, H hidden size, V vocabulary. Rope lives in rope.py.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

import pieceworks.backends.ops  # noqa: F401  (registers the pieceworks custom ops the models call)
from pieceworks.backends import cpu_matmul, fused
from pieceworks.backends.base import ModelFacts
from pieceworks.core.kv import KVLayout
from pieceworks.errors import ConfigError
from pieceworks.models.rope import RotaryEmbedding
from pieceworks.parallel.comm import gather, reduce
from pieceworks.parallel.layout import Part, TPLayout
from pieceworks.quant.linear import Fp4Linear
from pieceworks.quant.nvfp4 import BLOCK

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalized in float32 (as transformers' Llama/DeepSeek RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: the normalized x. With it: (normalized residual + x, residual + x), one
        fused op (the decoder blocks' residual add followed by their next norm)."""
        if residual is None:
            return fused.rms_norm(x, self.weight, self.eps)
        return fused.add_rms_norm(x, residual, self.weight, self.eps)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [V / N, H] of the embedding table: ids outside them give zeros, and the sum
    over the ranks (exactly one rank holds each id) is the embedding."""

    def __init__(self, num_embeddings: int, dim: int, tp: TPLayout) -> None:
        super().__init__()
        self.tp = tp
        self.num_local = num_embeddings // tp.size
        self.start = tp.rank * self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> [T, H]."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        h = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return reduce(h, self.tp)


class Prenormed(NamedTuple):
    """Handed from a block whose last GEMM prepared the next block's input RMSNorm (`fp4_gemm_add_norm`)
    in place of a residual: h is then the whole stream, and t / partials are that norm's inputs
    (`fp4_gemm.base.norm_inputs`). Blocks that do not use them take h as the stream."""

    t: torch.Tensor
    partials: torch.Tensor


def block_forward(block: nn.Module, h: torch.Tensor, residual: torch.Tensor | Prenormed | None, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm decoder block (`input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`) on
    the residual stream, whose value entering the block is residual + h (h alone when residual is None or
    `Prenormed`: the first block, or after a block that added its outputs itself). Returns (the MLP's
    output, the stream before that output is added): each residual add runs fused with the norm after it
    (the same roundings as the plain `h = h + attn(norm(h))`)."""
    if residual is None or isinstance(residual, Prenormed):
        x, residual = block.input_layernorm(h), h
    else:
        x, residual = block.input_layernorm(h, residual)
    x, residual = block.post_attention_layernorm(block.self_attn(x, cos, sin), residual)
    return block.mlp(x), residual


class DenseLinear(nn.Linear):
    """A bias-free nn.Linear that multiplies through `cpu_matmul.linear` on a CPU outside torch.compile
    (decode-sized rows read the weight up to 6x faster there); elsewhere `F.linear`."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dim() == 2 and not torch.compiler.is_compiling():
            return cpu_matmul.linear(x, self.weight)
        return F.linear(x, self.weight)


def linear(in_features: int, out_features: int, fp4: bool, part: Part | None = None) -> nn.Module:
    """A bias-free projection: `Fp4Linear` (NVFP4 weights, the fp4_gemm op) or `DenseLinear` (also where
    in_features is not a multiple of the NVFP4 block, which no NVFP4 export quantizes).

    Under tensor parallelism the sizes are this rank's and `part` says which slice of the checkpoint's
    weight it holds (dim 0: column-parallel, dim 1: row-parallel); the weight sources read `tp_part`."""
    if fp4 and in_features % BLOCK == 0:
        module: nn.Module = Fp4Linear(in_features, out_features)
    else:
        module = DenseLinear(in_features, out_features)
    module.tp_part = part
    return module


class MergedProj(nn.Module):
    """Several projections of one input computed by one linear: x [T, K] -> parts [T, N_i].

    `tp_parts`: per projection, which rows of its checkpoint weight this rank holds (None: all)."""

    def __init__(self, in_features: int, sizes: list[int], fp4: bool,
                 parts: list[Part | None] | None = None) -> None:
        super().__init__()
        self.sizes = list(sizes)
        self.tp_parts = list(parts) if parts else [None] * len(sizes)
        self.proj = linear(in_features, sum(sizes), fp4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.proj(x).split(self.sizes, dim=-1)


class SplitProj(nn.Module):
    """The same contract as MergedProj with one linear per part: used where NVFP4 parts can't be
    fused exactly (different global scales) or are stored in different formats."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(p(x) for p in self.parts)


def merged(in_features: int, sizes: list[int], fp4: list[bool], parts: list[Part | None] | None = None) -> nn.Module:
    """MergedProj when every part has the same format, else SplitProj (sizes and parts as MergedProj's)."""
    if len(set(fp4)) == 1:
        return MergedProj(in_features, sizes, fp4[0], parts)
    parts = parts or [None] * len(sizes)
    return SplitProj([linear(in_features, n, f, p) for n, f, p in zip(sizes, fp4, parts)])


class GatedMLP(nn.Module):
    """SwiGLU MLP, gate and up fused: x [T, H] -> down(silu(gate(x)) * up(x)) [T, H].

    Tensor parallel: gate/up column-parallel, down row-parallel over intermediate / N columns; the
    output is summed over the ranks unless `reduce_output` is False (the caller sums it with other
    partial results: a MoE layer's shared experts)."""

    def __init__(self, hidden: int, intermediate: int, prefix: str, fp4: Callable[[str], bool],
                 tp: TPLayout = TPLayout(), reduce_output: bool = True) -> None:
        super().__init__()
        self.tp = tp if reduce_output else TPLayout(tp.rank, tp.size, None, tp.expert_parallel)
        inter = intermediate // tp.size
        self.gate_up_proj = merged(hidden, [inter, inter], [fp4(f"{prefix}.gate_proj"), fp4(f"{prefix}.up_proj")],
                                   [tp.split(0), tp.split(0)])
        self.down_proj = linear(inter, hidden, fp4(f"{prefix}.down_proj"), tp.split(1))
        self._mark_gate_up()

    def _mark_gate_up(self) -> None:
        # One NVFP4 linear for gate and up: it runs as the fused fp4_gemm_swiglu op (Fp4Linear.gate_up).
        proj = getattr(self.gate_up_proj, "proj", None)
        self._swiglu = isinstance(proj, Fp4Linear)  # decided here, not per forward
        if self._swiglu:
            proj.gate_up = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._swiglu:
            return reduce(self.down_proj(self.gate_up_proj.proj.forward_swiglu(x)), self.tp)
        gate, up = self.gate_up_proj(x)
        return reduce(self.down_proj(fused.silu_mul(gate, up)), self.tp)

    def load(self, src: "WeightSource", prefix: str) -> None:
        self.gate_up_proj = src.merged(self.gate_up_proj, [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj = src.linear(self.down_proj, f"{prefix}.down_proj")
        self._mark_gate_up()


# --- Loading --------------------------------------------------------------------------------------


class WeightSource(Protocol):
    """Where the models' `load` methods get their tensors (a checkpoint, or random weights); names
    are Hugging Face tensor names. Implemented in `pieceworks.models.weights`."""

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None,
               part: Part | None = None) -> torch.Tensor:
        """A float tensor on the target device, cast to `dtype` (default: the model dtype); with `part`,
        that slice of the stored tensor (`shape` is the slice's)."""

    def has(self, name: str) -> bool:
        """Whether the source holds `name` (random sources hold everything)."""

    def dense(self, prefix: str, in_features: int, out_features: int,
              dtype: torch.dtype | None = None, part: Part | None = None) -> torch.Tensor:
        """`{prefix}.weight` [out, in] as a float tensor in `dtype` (default: the model dtype),
        dequantized if the checkpoint stores it as NVFP4; with `part`, that slice ([out, in] are the
        slice's sizes)."""

    def linear(self, module: nn.Module, prefix: str) -> nn.Module:
        """Fill an nn.Linear or Fp4Linear from `{prefix}.*` (the slice its `tp_part` names); returns it."""

    def merged(self, module: nn.Module, prefixes: list[str]) -> nn.Module:
        """Fill a MergedProj/SplitProj from several linears (the slices its `tp_parts` name); returns it,
        or a SplitProj that replaces it where NVFP4 parts can't be fused exactly."""

    def experts(self, module: nn.Module, prefix: str) -> None:
        """Fill an `Experts` module from `{prefix}.{e}.{gate,up,down}_proj.*` (its experts and slices)."""


class CausalLM(nn.Module):
    """A decoder-only LM over the flat token layout of one step.

    Subclasses build `embed_tokens`, `layers`, `norm`, `lm_head` (nn.Linear, or the embedding when
    tied) and `rotary`; every layer is called as `layer(h, residual, cos, sin)` and returns its output
    and the residual stream before that output is added (`block_forward`): the add is fused into the
    next norm. A block whose GEMMs add their outputs to the stream themselves returns (the stream, None
    or `Prenormed`) (`LlamaBlock._forward_fused_norms`): h is then the whole stream.

    Attributes:
        vocab_size, max_position_embeddings: from the HF config.
        dtype: activation dtype.
        hf_config: the config.json dict the model was built from.
        tp: this rank's place in the tensor-parallel group (`TPLayout()`: the whole model).
    """

    arch: str = ""
    tp: TPLayout = TPLayout()
    checkpoint_names: Any = staticmethod(lambda hf_config: None)
    """`checkpoint_names(hf_config)`: a function from the model's tensor and module names to the checkpoint's, for
    checkpoints that name them otherwise (Mixtral's, Phi-3's, GLM-4's: `Llama.checkpoint_names`), with
    `rows(name)` where a tensor is rows of a fused one (`RenamingReader`); None where they agree."""
    vocab_size: int
    max_position_embeddings: int
    context_cap: tuple[int, str] | None = None
    """A limit below max_position_embeddings on the sequences run as the model defines them, and why (a sliding
    window, longrope's original context: `hf_config.context_cap`): the longest context (`context_limit`)."""
    dtype: torch.dtype
    hf_config: dict[str, Any]
    kv_cache_quant: str | None = None
    """"fp8" where the checkpoint asks for an FP8 KV cache (set by the loader; `kv_cache.dtype: auto` follows it)."""
    kv_scales: list[tuple[float, float]] | None = None
    """The checkpoint's (k_scale, v_scale) per layer for an FP8 KV cache (None: 1.0 each)."""

    def _build_trunk(self, hf_config: dict, dtype: torch.dtype, args, blocks: list[nn.Module],
                     rope_dim: int, tp: TPLayout = TPLayout()) -> None:
        """Embeddings, blocks, final norm, head (tied or not) and rope tables: the parts every model has.
        Tensor parallel: the embedding and the head hold V / N rows each (vocab-parallel)."""
        self.hf_config, self.dtype, self.tp = dict(hf_config), dtype, tp
        self.vocab_size, self.max_position_embeddings = args.vocab_size, args.max_position_embeddings
        if tp.sharded:
            self.embed_tokens: nn.Module = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp)
        else:
            # `_weight` skips nn.Embedding's normal_ init, which on the meta device imports torch._dynamo
            # (about 1 s) for values the load replaces
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                             _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = (self.embed_tokens if args.tie_word_embeddings
                        else nn.Linear(args.hidden_size, args.vocab_size // tp.size, bias=False))
        self.rotary = RotaryEmbedding(args.rope, rope_dim, args.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, H] (final norm applied).

        Runs inside a forward context (the attention ops read the step's metadata and KV pool there).
        """
        cos, sin = self.rotary(positions)
        h, residual = self.embed(input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin)
        if residual is None or isinstance(residual, Prenormed):
            return self.norm(h)
        return self.norm(h, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def rope_tables(self) -> list[RotaryEmbedding]:
        """The model's rope tables (the loader sizes each for the positions the executor can reach)."""
        return [self.rotary]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, V] float32. Plain torch (and, tensor parallel, the all-gather of
        the ranks' V / N columns): callable outside a forward context."""
        w = self.lm_head.weight
        if hidden.device.type == "cpu" and not torch.compiler.is_compiling():
            return gather(cpu_matmul.linear(hidden, w).float(), self.tp)  # decode-sized rows much faster
        return gather(F.linear(hidden, w).float(), self.tp)

    def kv_layout(self) -> KVLayout:
        """Per-token KV shape for the pool: GQA heads or the MLA latent."""
        raise NotImplementedError

    def facts(self, page_size: int) -> ModelFacts:
        """What backends may know about the model (for selection and checks)."""
        raise NotImplementedError

    def required_ops(self) -> set[str]:
        """The `pieceworks` ops forward calls (the kernel table is resolved for these only)."""
        raise NotImplementedError

    def load_plan(self) -> list[tuple[str, nn.Module, Callable[[WeightSource], None]]]:
        """(label, module, fill) in load order: the loader materializes `module` from the meta device,
        then calls `fill(source)`. Together they cover every parameter and buffer."""
        hidden = self.norm.weight.shape[0]
        rows = self.tp.split(0)  # vocab-parallel embedding and head

        # Parameters are looked up when filled: to_empty replaces the meta ones.
        def fill(module: nn.Module, name: str, src: WeightSource, part: Part | None = None) -> None:
            module.weight.copy_(src.tensor(name, tuple(module.weight.shape), part=part))

        def head(src: WeightSource) -> None:
            self.lm_head.weight.copy_(src.dense("lm_head", hidden, self.vocab_size // self.tp.size, part=rows))

        plan = [("embed_tokens", self.embed_tokens,
                 partial(fill, self.embed_tokens, "model.embed_tokens.weight", part=rows))]
        for i, layer in enumerate(self.layers):
            plan.append((f"layer {i}", layer, partial(layer.load, prefix=f"model.layers.{i}")))
        plan.append(("norm", self.norm, partial(fill, self.norm, "model.norm.weight")))
        if self.lm_head is not self.embed_tokens:
            plan.append(("lm_head", self.lm_head, head))
        plan.append(("rotary", self.rotary, lambda src: self.rotary.init_buffers()))
        return plan

    def expert_blocks(self) -> list[nn.Module]:
        """The model's routed-expert modules (`models.moe.Experts`, which imports this module)."""
        return [m for m in self.modules() if hasattr(m, "prepare_experts")]

    def moe_facts(self) -> dict[str, Any]:
        """`ModelFacts`' moe_experts (this rank's, 0 without experts) and moe_quant."""
        experts = self.expert_blocks()
        return {"moe_experts": experts[0].num_experts if experts else 0,
                "moe_quant": "nvfp4" if any(e.fp4 for e in experts) else "none"}

    def has_fp4(self) -> bool:
        return any(isinstance(m, Fp4Linear) for m in self.modules())

    def prepare(self, table: Any) -> None:
        """Convert every Fp4Linear and expert block to the layouts of the backends `table` chose
        (`KernelTable`); once, after loading. The registry guarantees one layout per op. A layer whose
        weights a backend refuses (ValueError, e.g. NaN block scales) is named in the error."""
        fp4 = table.instances("fp4_gemm")
        moe = table.instances("moe")
        for name, m in self.named_modules():
            if isinstance(m, Fp4Linear):
                if not fp4:
                    raise ValueError(f"{name} is NVFP4 but the kernel table has no fp4_gemm backend")
                try:
                    m.prepare(fp4[0])
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
            elif hasattr(m, "prepare_experts"):  # models.moe.Experts (which imports this module)
                if not moe:
                    raise ValueError(f"{name} holds experts but the kernel table has no moe backend")
                try:
                    m.prepare_experts(moe[0])
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None


def context_limit(model: CausalLM, max_context: int | None, warn: bool = False) -> int:
    """The longest sequence `model` serves under `model.max_context` (None: unset): max_position_embeddings, or
    the model's `context_cap` where it has one (an unset max_context then takes the cap, with a warning if `warn`).

    Raises:
        ConfigError: max_context above either.
    """
    positions = model.max_position_embeddings
    if max_context and max_context > positions:
        raise ConfigError(f"model.max_context: {max_context} exceeds the model's max_position_embeddings "
                          f"({positions}); use at most that")
    if model.context_cap is None:
        return max_context or positions
    cap, why = model.context_cap
    if max_context and max_context > cap:
        raise ConfigError(f"model.max_context: {max_context} exceeds {cap} tokens, the limit of {why}; use "
                          f"model.max_context <= {cap}")
    if not max_context and warn:
        log.warning("the context is capped at %d tokens by %s", cap, why)
    return max_context or cap
