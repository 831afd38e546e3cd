"""A plain-torch forward of a pieceworks Llama's weights: the floor that `graphs.py` holds pieceworks'
eager extend against (its `plain ms` column).

No custom ops, no forward context, no kernel table, no nn.Module calls: one Python loop over the
layers, each a handful of direct kernel calls, gpt-fast style. The kernels are those of pieceworks'
eager path, so the two differ only in host work: `F.linear` for the projections; on CUDA the fused
Triton kernels of `pieceworks.backends.fused_kernels` (RMSNorm, rope, SiLU-and-multiply), the fused K/V
write and FlashInfer's paged prefill (planned once per step, `run()` per layer); on the CPU the torch
code of those ops and of the torch attention backend (`index_copy_` into the pages, gathered pages,
float32 softmax), so the outputs match pieceworks' bit for bit.

It reads and writes the executor's own KV pool. bf16/fp16/fp32 Llama weights only (no NVFP4).

Shape legend: T tokens, H hidden, Hq / Hkv query / KV heads, D head size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pieceworks.backends.attention.torch import attend
from pieceworks.backends import fused


class PlainLlama:
    """The forward of `model` (a pieceworks `Llama`, loaded) over the paged pool `kv`.

    Per step: `plan(pages, prefix_lens, extend_lens, slots)` once, then `forward(ids, positions)`.
    """

    def __init__(self, model, kv, flashinfer_variant: str = "fa2") -> None:
        a = model.args
        self.hq, self.hkv, self.d = a.num_heads, a.num_kv_heads, a.head_dim
        self.scale = a.head_dim**-0.5
        self.embed, self.norm = model.embed_tokens.weight, (model.norm.weight, model.norm.eps)
        self.cos_table, self.sin_table = model.rotary.cos, model.rotary.sin
        self.layers = []
        for i, b in enumerate(model.layers):
            qkv, gate_up = b.self_attn.qkv_proj, b.mlp.gate_up_proj
            if not (hasattr(qkv, "proj") and isinstance(qkv.proj, torch.nn.Linear)
                    and isinstance(gate_up.proj, torch.nn.Linear)):
                raise ValueError("PlainLlama runs dense (bf16/fp16/fp32) Llama weights only")
            kc, vc = kv.k_cache(i), kv.v_cache(i)
            self.layers.append((
                b.input_layernorm.weight, b.post_attention_layernorm.weight, b.input_layernorm.eps,
                qkv.proj.weight, b.self_attn.o_proj.weight, gate_up.proj.weight, b.mlp.down_proj.weight,
                kc, vc, kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:]),
            ))
        self.qkv_sizes = [self.hq * self.d, self.hkv * self.d, self.hkv * self.d]
        self.inter = model.args.intermediate_size
        self.cuda = self.embed.is_cuda
        if self.cuda:
            import flashinfer

            from pieceworks.backends.kv_write import write_rows
            from pieceworks.backends import fused_kernels as fk

            self.rms_norm, self.add_rms_norm, self.silu_mul = fk.rms_norm, fk.add_rms_norm, fk.silu_mul
            self.rope_qk = lambda q, k, cos, sin: fk.rope_qk(q, k, cos, sin, False)
            self.write_rows = write_rows
            ws = torch.zeros(128 << 20, dtype=torch.uint8, device=self.embed.device)
            self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=flashinfer_variant)
        else:
            self.rms_norm, self.add_rms_norm = fused.rms_norm_ref, fused.add_rms_norm_ref
            self.silu_mul = fused.silu_mul_ref
            self.rope_qk = lambda q, k, cos, sin: fused.rope_qk_ref(q, k, cos, sin, False)

    def plan(self, pages: list[list[int]], prefix_lens: list[int], extend_lens: list[int],
             slots: torch.Tensor) -> None:
        """Host work of one step. pages: every sequence's KV pages; slots [T] int64 on the device: the
        KV slot of every new token."""
        self.slots = slots
        page_size = self.layers[0][7].shape[1]
        kv_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        counts = [-(-n // page_size) for n in kv_lens]
        if self.cuda:
            dev, i32 = slots.device, torch.int32
            qo, kv_ptr, flat = [0], [0], []
            for n, c, p in zip(extend_lens, counts, pages):
                qo.append(qo[-1] + n)
                flat += p[:c]
                kv_ptr.append(len(flat))
            last = [n - (c - 1) * page_size for n, c in zip(kv_lens, counts)]
            self.prefill.plan(torch.tensor(qo, dtype=i32), torch.tensor(kv_ptr, dtype=i32),
                              torch.tensor(flat, dtype=i32).to(dev, non_blocking=True), torch.tensor(last, dtype=i32),
                              self.hq, self.hkv, self.d, page_size, causal=True, q_data_type=self.embed.dtype,
                              kv_data_type=self.embed.dtype, sm_scale=self.scale)
            return
        self.seqs, row = [], 0
        for p, n, s, c, pg in zip(prefix_lens, extend_lens, kv_lens, counts, pages):
            self.seqs.append((p, s, torch.tensor(pg[:c]), slice(row, row + n)))
            row += n

    def attention(self, q, k, v, kc, vc, k_rows, v_rows) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D], after writing k/v at the step's slots."""
        if self.cuda:
            self.write_rows(k_rows.view(k_rows.shape[0], -1), k.reshape(k.shape[0], -1),
                            v_rows.view(v_rows.shape[0], -1), v.reshape(v.shape[0], -1), self.slots)
            return self.prefill.run(q, (kc, vc)).view(q.shape[0], -1)
        k_rows.index_copy_(0, self.slots, k)
        v_rows.index_copy_(0, self.slots, v)
        outs = [attend(q[rows], kc[pages].flatten(0, 1)[:n], vc[pages].flatten(0, 1)[:n], self.scale, prefix)
                for prefix, n, pages, rows in self.seqs]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.to(q.dtype).view(q.shape[0], -1)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids [T] int64, positions [T] int64 -> hidden [T, H] after the final norm."""
        cos, sin = self.cos_table[positions], self.sin_table[positions]
        h, residual = F.embedding(ids, self.embed), None
        t = ids.shape[0]
        for n1, n2, eps, w_qkv, w_o, w_gate_up, w_down, kc, vc, k_rows, v_rows in self.layers:
            if residual is None:
                x, residual = self.rms_norm(h, n1, eps), h
            else:
                x, residual = self.add_rms_norm(h, residual, n1, eps)
            q, k, v = F.linear(x, w_qkv).split(self.qkv_sizes, dim=-1)
            q, k = self.rope_qk(q.view(t, self.hq, self.d), k.view(t, self.hkv, self.d), cos, sin)
            o = self.attention(q, k, v.view(t, self.hkv, self.d), kc, vc, k_rows, v_rows)
            x, residual = self.add_rms_norm(F.linear(o, w_o), residual, n2, eps)
            gate, up = F.linear(x, w_gate_up).split([self.inter, self.inter], dim=-1)
            h = F.linear(self.silu_mul(gate, up), w_down)
        return self.add_rms_norm(h, residual, *self.norm)[0]


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="A module, not a benchmark of its own: graphs.py builds a PlainLlama from its executor's "
               "model and KV pool and times it next to the eager extend (--plain on, the default, for a "
               "Llama without NVFP4), e.g. python benchmarks/graphs.py --extend 16,256 --decode ''.")
    p.parse_args()
    p.print_help()


if __name__ == "__main__":
    main()
