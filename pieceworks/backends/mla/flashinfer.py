"""FlashInfer MLA (`flashinfer.mla.BatchMLAPagedAttentionWrapper`, fa2/fa3) over the latent cache.

Absorbed form, one wrapper for decode, extend and mixed steps (causal with the query block aligned to
the end of each sequence), plus one CUDA-graph wrapper per graph batch size for FULL decode graphs.
The latent cache [pages, page_size, L + R] is handed over as FlashInfer's "packed" KV cache: the wrapper
splits it into the ckv [.., :L] and kpe [.., L:] strided views itself (fa2/fa3 read the page and token
strides of both), so the cache is never copied. Queries go in split, as the model produces them.

FlashInfer's plans take head counts that divide its 64-row query tile, or 128 (`planned_heads`): another count
(GLM-4.7-Flash's 20, 10 per rank under tensor parallel 2) is planned and run at the next such count, the queries
padded with zero heads (their outputs, finite, are dropped); the padding's copies add a few small kernels per layer.

Plan/run, the CSR conversion and the softmax-scale handling are those of the FlashInfer attention
backend (attention/flashinfer.py). Once a wrapper has been planned twice, its plans go through
`FastMLAPlan` (FlashInfer's planner called directly; `backends.options.flashinfer.fast_plan`), and eager and
piecewise steps launch through `FastMLARun` (its kernel module called directly) after one `run()`.
"""

from __future__ import annotations

import torch

from pieceworks.backends.attention.flashinfer import (
    GPU_INSTALL_HINT,
    FlashInferOptions,
    check_capture_scale,
    log,
    paged_kv_indices,
    qo_indptr,
    resolve_variant,
    step_lengths,
    workspace,
)
from pieceworks.backends.attention.flashinfer_fast import PlanCopyGuard
from pieceworks.backends.base import ALL_GRAPH_MODES, Requirements
from pieceworks.backends.kv_write import write_rows
from pieceworks.backends.mla.base import MLABackend
from pieceworks.backends.mla.flashinfer_fast import FastMLAPlan, FastMLARun
from pieceworks.core.batch import ForwardMode, GraphMode

FA_TILE_Q = 64  # FlashInfer's MLA query tile (rows = tokens x heads); clusters of 2 tiles above 64 rows


def mla_plan_args(meta, sm_scale: float, num_heads: int, kv_lora_rank: int, rope_dim: int,
                  dtype: torch.dtype) -> dict:
    """Keyword arguments of `BatchMLAPagedAttentionWrapper.plan` for one step (pure torch; the CSR
    metadata goes in through `flashinfer.mla.MLAPlanMetadata.csr(**args.pop("csr"))`).

    Decode steps are planned non-causal (one query per sequence sees its whole KV); extend and mixed
    steps causal, FlashInfer aligning each sequence's queries to the end of its KV.
    """
    qo_lens, kv_lens = step_lengths(meta)
    kv = paged_kv_indices(meta.page_table[: len(kv_lens)], kv_lens, meta.page_size, meta.page_lists)
    return dict(
        csr=dict(qo_indptr=qo_indptr(qo_lens), kv_indptr=kv.indptr, kv_indices=kv.indices,
                 kv_len_arr=kv.kv_lens),
        num_heads=num_heads, head_dim_ckv=kv_lora_rank, head_dim_kpe=rope_dim, page_size=meta.page_size,
        causal=meta.mode is not ForwardMode.DECODE, sm_scale=sm_scale, q_data_type=dtype,
        kv_data_type=dtype, query_layout="split", kv_cache_layout="packed",
    )


def planned_heads(num_heads: int) -> int:
    """The head count FlashInfer plans for `num_heads`: the smallest divisor of 64 at or above it, else 128."""
    return next((h for h in (1, 2, 4, 8, 16, 32, 64) if h >= num_heads), 2 * FA_TILE_Q)


FA3_RANKS = (128, 256, 512)  # the latent widths FlashInfer's fa3 MLA kernels are built for


class FlashInferMLABackend(MLABackend):
    name = "flashinfer"
    priority = 100
    graph_modes = ALL_GRAPH_MODES
    requires = Requirements(devices=("cuda",), min_capability=(8, 0), modules=("flashinfer",),
                            install_hint=GPU_INSTALL_HINT)
    Options = FlashInferOptions
    description = "FlashInfer BatchMLAPagedAttentionWrapper (fa2/fa3), absorbed, CUDA-graph wrappers"

    @classmethod
    def check(cls, spec):
        reasons = super().check(spec)
        m = spec.model
        if not m.kv_lora_rank:
            return reasons + ["the model has no MLA (kv_lora_rank 0)"]
        if m.kv_lora_rank % 128 or m.qk_rope_head_dim % 64:
            reasons.append(f"FlashInfer MLA needs kv_lora_rank % 128 == 0 and qk_rope_head_dim % 64 == 0 "
                           f"(model: {m.kv_lora_rank}, {m.qk_rope_head_dim})")
        if m.dtype not in (torch.float16, torch.bfloat16):
            reasons.append(f"needs bf16 or fp16 activations (model dtype: {m.dtype})")
        # FlashInfer refuses causal plans whose query tile (64 or 128 rows) splits a token's heads
        # across tiles at a KV-tile boundary; with heads dividing 64, or 128, that never happens (others are
        # padded to such a count: planned_heads)
        if m.num_heads > 2 * FA_TILE_Q:
            reasons.append(f"FlashInfer MLA plans take at most 128 heads (model: {m.num_heads})")
        return reasons

    def __init__(self, spec, options=None) -> None:
        super().__init__(spec, options)
        self.variant = resolve_variant(self.options.variant, spec.capability)
        if self.variant == "fa3" and spec.model.kv_lora_rank not in FA3_RANKS:
            if self.options.variant != "auto":
                raise ValueError(f"FlashInfer fa3 MLA needs kv_lora_rank 128, 256 or 512 (model: "
                                 f"{spec.model.kv_lora_rank}); set backends.options.flashinfer.variant=fa2")
            self.variant = "fa2"  # auto picks the variant that takes the model's latent width
        # DeepSeek's scale is (nope + rope)^-0.5 times a yarn factor, unknown here: the first forward
        # re-plans with the model's own.
        self._sm_scale = (spec.model.kv_lora_rank // 4 + spec.model.qk_rope_head_dim) ** -0.5
        self._heads = planned_heads(spec.model.num_heads)
        self._workspace: torch.Tensor | None = None
        self._eager = None
        self._graph: dict[int, object] = {}
        self._plan_guard = PlanCopyGuard()
        self._meta = None
        self._wrapper = None
        self._rows = 0
        self._fast: dict[int, FastMLAPlan | None] = {}  # id(wrapper) -> its FastMLAPlan (None: refused)
        self._fast_run: FastMLARun | None = None
        self._fast_run_refused = False  # a recorded run() had another form: no more tries
        # layer -> (KV pool, latent cache, its ckv and kpe views, and those of its rows for the K/V write)
        self._views: dict[int, tuple] = {}

    # ------------------------------------------------------------------ plan (host)
    def plan(self, meta) -> None:
        self._meta = meta
        m = self.spec.model
        args = mla_plan_args(meta, self._sm_scale, self._heads, m.kv_lora_rank, m.qk_rope_head_dim, m.dtype)
        csr = args.pop("csr")
        bs = csr["kv_len_arr"].shape[0]
        if meta.graph_mode is GraphMode.FULL:
            wrapper = self._graph_wrapper(bs, meta.page_table.shape[1], meta.device)
        else:
            wrapper = self._eager_wrapper(meta.device)
        self._plan_guard.before(wrapper)
        self._plan_wrapper(wrapper, csr, args)
        self._plan_guard.after(wrapper, meta.device)
        self._wrapper = wrapper
        self._rows = int(csr["qo_indptr"][-1])

    def _plan_wrapper(self, wrapper, csr: dict, args: dict) -> None:
        """The wrapper's plan: through its FastMLAPlan where it has one that takes the step, else FlashInfer's
        public plan. With `fast_plan` on, a public plan of a wrapper planned before records its FastMLAPlan;
        after a step its FastMLAPlan gave back to the public plan, the next plan records anew."""
        key, dims = id(wrapper), (args["num_heads"], args["head_dim_ckv"], args["causal"], args["page_size"])

        def public() -> None:  # imports flashinfer.mla only where the public plan runs
            from flashinfer.mla import MLAPlanMetadata

            wrapper.plan(metadata=MLAPlanMetadata.csr(**csr), **args)

        if key in self._fast:
            fast = self._fast[key]
            if fast is None:  # refused: FlashInfer's planner is called in another form
                public()
            elif not fast(wrapper, csr, *dims):
                del self._fast[key]  # the public plan makes a new planned backend: record it next time
                public()
            return
        if not self.options.fast_plan or getattr(wrapper, "_planned_backend", None) is None:
            public()  # the first plan of a wrapper: its planner module is not known yet
            return
        self._fast[key] = FastMLAPlan.record(wrapper, public, csr, *dims)
        if self._fast[key] is None:
            log.warning("FlashInfer's MLA planner is called in another form than FlashInfer 0.7's; MLA steps "
                        "plan through its public plan() (slower on the host, same results)")

    def _ws(self, device) -> torch.Tensor:
        return workspace(self, device)

    def _eager_wrapper(self, device):
        if self._eager is None:
            from flashinfer.mla import BatchMLAPagedAttentionWrapper

            self._eager = BatchMLAPagedAttentionWrapper(self._ws(device), backend=self.variant)
        return self._eager

    def _graph_wrapper(self, bs: int, width: int, device):
        """The wrapper captured for graph batch size `bs`, with CSR buffers at fixed addresses."""
        if bs not in self._graph:
            from flashinfer.mla import BatchMLAPagedAttentionWrapper

            i32 = dict(dtype=torch.int32, device=device)
            self._graph[bs] = BatchMLAPagedAttentionWrapper(
                self._ws(device), use_cuda_graph=True, qo_indptr=torch.zeros(bs + 1, **i32),
                kv_indptr=torch.zeros(bs + 1, **i32), kv_indices=torch.zeros(bs * width, **i32),
                kv_len_arr=torch.ones(bs, **i32), backend=self.variant)
        return self._graph[bs]

    # ------------------------------------------------------------------ run (capturable)
    def forward(self, q_nope, q_pe, c_kv, k_pe, out, layer_id, scale, kv) -> None:
        if check_capture_scale(self, scale):
            self._sm_scale = scale
            self._fast.clear()  # the planned backends hold the old scale; public plans set the new one
            self.plan(self._meta)
        rank = q_nope.shape[-1]
        views = self._views.get(layer_id)
        if views is None or views[0] is not kv:
            cache = kv.latent_cache(layer_id)
            flat = cache.view(-1, cache.shape[-1])
            views = self._views[layer_id] = (kv, cache, cache[..., :rank], cache[..., rank:], flat[:, :rank],
                                             flat[:, rank:])
        _, cache, ckv, kpe, ckv_rows, kpe_rows = views
        slots = self._meta.slot_mapping[: c_kv.shape[0]]  # padded tokens write to the reserved page
        write_rows(ckv_rows, c_kv, kpe_rows, k_pe, slots)
        rows, wrapper = self._rows, self._wrapper
        q_nope, q_pe, run_out = q_nope[:rows], q_pe[:rows], out[:rows]
        heads = q_nope.shape[1]
        if heads != self._heads:  # zero heads up to a count FlashInfer plans
            pad = self._heads - heads
            q_nope, q_pe = (torch.cat([t, t.new_zeros(rows, pad, t.shape[2])], 1) for t in (q_nope, q_pe))
            run_out = out.new_empty(rows, self._heads, out.shape[2])
        if wrapper is self._eager:
            self._run_eager(wrapper, q_nope, q_pe, cache, ckv, kpe, run_out)
        else:  # a FULL graph's wrapper: its run() is captured once
            wrapper.run(query=(q_nope, q_pe), kv_cache=cache, out=run_out)
        if heads != self._heads:
            out[:rows].copy_(run_out[:, :heads])
        if out.shape[0] > rows:
            out[rows:].zero_()

    def _run_eager(self, wrapper, q_nope, q_pe, cache, ckv, kpe, out) -> None:
        """The eager wrapper's run() through its FastMLARun; the first call records one (and runs)."""
        fast = self._fast_run
        if fast is not None and fast(wrapper, q_nope, q_pe, ckv, kpe, out):
            return
        if fast is None and not self._fast_run_refused:
            self._fast_run = FastMLARun.record(wrapper, q_nope, q_pe, cache, out, ckv, kpe)
            self._fast_run_refused = self._fast_run is None
            return
        wrapper.run(query=(q_nope, q_pe), kv_cache=cache, out=out)
