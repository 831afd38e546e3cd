"""TRT-LLM MLA on Blackwell through `flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla`, as SGLang's
`trtllm_mla` backend calls it: query = [q_nope | q_pe] [B, 1, H, L + R], the latent cache as is
[pages, page_size, L + R], a dense block table, int32 KV lengths, bmm1_scale = softmax scale.

Extend: SGLang's trtllm_mla extends with a non-absorbed ragged kernel (`trtllm_ragged_attention_deepseek`
over per-head K/V), which the absorbed `mla` op has no inputs for, and its multi-token decode path
uses a dense mask (every query sees the whole KV: FlashInfer's launcher sets Dense for MLA generation).
So extend and mixed steps run the same decode kernel on one row per new token, each row seeing its own
causal prefix (KV length = position + 1) through its sequence's block-table row: causal by construction,
with no semantics beyond single-token decode. Correct, though it re-reads the prefix per token, so long
prefills are slower than FlashInfer MLA.

Graph safety: FULL decode graphs (static block table, lengths, and a max_seq_len bound fixed at
capture). Not PIECEWISE: extend under piecewise graphs resolves to FlashInfer MLA (the registry logs it),
as SGLang falls back to FlashInfer MLA under its piecewise graphs.

Written against FlashInfer 0.7.2's documented API; no Blackwell GPU was available to run it.
"""

from __future__ import annotations

import torch

from pieceworks.backends.attention.flashinfer import GPU_INSTALL_HINT, workspace
from pieceworks.backends.attention.torch import _static_seq_lens
from pieceworks.backends.base import ALL_FORWARD_MODES, Requirements
from pieceworks.backends.kv_write import write_rows
from pieceworks.backends.mla.base import MLABackend
from pieceworks.core.batch import GraphMode

WORKSPACE_BYTES = 150 << 20  # SGLang's size; zero-initialised once (the kernels keep semaphores there)
# (kv_lora_rank, qk_rope_head_dim) -> qk_nope_head_dim, the MLA shapes TRT-LLM's kernels are built for
# (FlashInfer's deepseek_mla_dimensions and smaller_mla_dimensions).
TRTLLM_MLA_DIMS = {(512, 64): 128, (256, 64): 64}


def token_rows(extend_lens: list[int], prefix_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode row per new token: (sequence of each row [n] int64, KV length of each row [n] int32).

    Token j of a sequence with prefix p sees KV positions 0..p+j, so its row has length p + j + 1.
    """
    seq = torch.repeat_interleave(torch.arange(len(extend_lens)), torch.tensor(extend_lens, dtype=torch.int64))
    lens = [p + j + 1 for p, n in zip(prefix_lens, extend_lens) for j in range(n)]
    return seq, torch.tensor(lens, dtype=torch.int32)


class TrtllmMLABackend(MLABackend):
    name = "trtllm"
    priority = 90  # below FlashInfer MLA: `auto` keeps its faster extend; pin `backends.mla: {decode: trtllm}`
    requires = Requirements(devices=("cuda",), capability_majors=(10,), modules=("flashinfer",),
                            install_hint=GPU_INSTALL_HINT)
    forward_modes = ALL_FORWARD_MODES
    graph_modes = frozenset({GraphMode.EAGER, GraphMode.FULL})
    description = "TRT-LLM MLA decode kernel via FlashInfer (Blackwell); extend as one row per token"

    @classmethod
    def check(cls, spec):
        reasons = super().check(spec)
        m = spec.model
        if m.page_size not in (32, 64):
            reasons.append(f"TRT-LLM MLA needs page_size 32 or 64 (kv_cache page size: {m.page_size})")
        if (m.kv_lora_rank, m.qk_rope_head_dim) not in TRTLLM_MLA_DIMS:
            reasons.append(f"TRT-LLM MLA is built for (kv_lora_rank, rope) in {sorted(TRTLLM_MLA_DIMS)} "
                           f"(model: ({m.kv_lora_rank}, {m.qk_rope_head_dim}))")
        if 64 < m.num_heads < 128:
            reasons.append(f"TRT-LLM MLA does not support 64 < num_heads < 128 (model: {m.num_heads})")
        if m.dtype != torch.bfloat16:
            reasons.append(f"TRT-LLM MLA writes bf16 only (model dtype: {m.dtype})")
        return reasons

    def __init__(self, spec, options=None) -> None:
        super().__init__(spec, options)
        m = spec.model
        self.qk_nope_head_dim = TRTLLM_MLA_DIMS.get((m.kv_lora_rank, m.qk_rope_head_dim), 0)
        self._workspace: torch.Tensor | None = None
        self._counter: torch.Tensor | None = None
        self._static_lens: dict[int, torch.Tensor] = {}
        self._meta = None

    def plan(self, meta) -> None:
        self._meta = meta
        if meta.graph_mode is GraphMode.FULL:
            # Replays read the runner's static page table; the length bound is baked in at capture.
            self._tables = meta.page_table
            self._lens = _static_seq_lens(self._static_lens, meta)
            self._max_len = meta.page_table.shape[1] * meta.page_size
        else:
            seq, lens = token_rows(meta.extend_lens, meta.prefix_lens)
            self._tables = meta.page_table.index_select(0, seq.to(meta.device, non_blocking=True))
            self._lens = lens.to(meta.device, non_blocking=True)
            self._max_len = int(lens.max())
        self._buffers(meta.device, self._lens.shape[0])

    def _buffers(self, device, rows: int) -> None:
        """Workspace and the multi-CTA counters (zeroed once; the kernel resets them), grown outside
        graph capture to fit `rows` query rows."""
        from flashinfer.utils import get_trtllm_gen_multi_ctas_kv_counter_bytes

        workspace(self, device, WORKSPACE_BYTES)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        need = get_trtllm_gen_multi_ctas_kv_counter_bytes(rows, self.spec.model.num_heads, sms)
        if self._counter is None or self._counter.numel() < need:
            self._counter = torch.zeros(need, dtype=torch.uint8, device=device)

    def forward(self, q_nope, q_pe, c_kv, k_pe, out, layer_id, scale, kv) -> None:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla

        cache = kv.latent_cache(layer_id)
        rank = q_nope.shape[-1]
        flat = cache.view(-1, cache.shape[-1])
        slots = self._meta.slot_mapping[: c_kv.shape[0]]
        write_rows(flat[:, :rank], c_kv, flat[:, rank:], k_pe, slots)
        rows = self._lens.shape[0]
        query = torch.cat([q_nope[:rows], q_pe[:rows]], dim=-1).unsqueeze(1)  # [rows, 1, H, L + R]
        trtllm_batch_decode_with_kv_cache_mla(
            query=query, kv_cache=cache, workspace_buffer=self._workspace,
            qk_nope_head_dim=self.qk_nope_head_dim, kv_lora_rank=rank, qk_rope_head_dim=q_pe.shape[-1],
            block_tables=self._tables, seq_lens=self._lens, max_seq_len=self._max_len,
            out=out[:rows].unsqueeze(1), bmm1_scale=scale, bmm2_scale=1.0, backend="trtllm-gen",
            multi_ctas_kv_counter_buffer=self._counter,
        )
        if out.shape[0] > rows:
            out[rows:].zero_()
