"""A correct out-of-tree attention backend and broken copies of it, for tests/test_conformance_suite.py.

`mykernels.plugin` is docs/plugins.md's example backend, written out by the test as a plugin author
would install it. `TiledAttention` is that backend as a kernel with a real shape limit (it works in
head_dim tiles of 64 and says so in `check()`); every other class here breaks one promise of the
attention contract, the way the issue's broken plugins did. The suite must pass the first two and fail
every other one.
"""

from __future__ import annotations

import torch
from mykernels.plugin import MyAttentionBackend

from pieceworks import hookimpl

TILE = 64


class TiledAttention(MyAttentionBackend):
    """Correct: head_dim is worked in tiles of 64, and check() refuses the head sizes that aren't."""

    name = "tiled"

    @classmethod
    def check(cls, spec):
        reasons = super().check(spec)
        if spec.model.head_dim % TILE:
            reasons.append(f"head_dim must be a multiple of {TILE} (model: {spec.model.head_dim})")
        return reasons

    def forward(self, q, k, v, out, layer_id, scale, kv):
        whole = q.shape[-1] // TILE * TILE  # a kernel built for whole tiles drops the remainder
        if whole != q.shape[-1]:
            q = q.clone()
            q[..., whole:] = 0
        super().forward(q, k, v, out, layer_id, scale, kv)


class AcceptsAnyHeadDim(TiledAttention):
    name = "anyheaddim"

    @classmethod
    def check(cls, spec):
        return MyAttentionBackend.check.__func__(cls, spec)


class _ScratchPool:
    """The pool's caches copied: forward reads its prefix, its writes never reach the real pool."""

    def __init__(self, kv):
        self.kv, self.copies = kv, {}

    def __getattr__(self, name):  # dtype, scales, ...: the pool's
        return getattr(self.kv, name)

    def k_cache(self, layer):
        return self.copies.setdefault(("k", layer), self.kv.k_cache(layer).clone())

    def v_cache(self, layer):
        return self.copies.setdefault(("v", layer), self.kv.v_cache(layer).clone())


class NoKVWrite(MyAttentionBackend):
    name = "nokvwrite"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        super().forward(q, k, v, out, layer_id, scale, _ScratchPool(kv))


class IgnoresLayerId(MyAttentionBackend):
    name = "ignoreslayer"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        super().forward(q, k, v, out, 0, scale, kv)


class IgnoresScale(MyAttentionBackend):
    name = "ignoresscale"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        super().forward(q, k, v, out, layer_id, q.shape[-1] ** -0.5, kv)


class StalePlan(MyAttentionBackend):
    name = "staleplan"

    def plan(self, meta):
        if self.meta is None:  # plans once, then keeps the first step's lengths
            super().plan(meta)


class NaNPaddedRows(MyAttentionBackend):
    name = "nanpadded"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        super().forward(q, k, v, out, layer_id, scale, kv)
        out[self.meta.num_tokens :] = float("nan")


class NoPaddedKVWrite(MyAttentionBackend):
    name = "nopaddedkv"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        n = self.meta.num_tokens
        super().forward(q[:n], k[:n], v[:n], out[:n], layer_id, scale, kv)
        out[n:] = 0


class SyncsInForward(MyAttentionBackend):
    """Declares FULL (inherited) but syncs with the host and allocates in forward."""

    name = "syncs"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        longest = int(self.meta.positions.max().item()) + 1
        scratch = torch.empty(longest, device=q.device)
        scratch.zero_()
        super().forward(q, k, v, out, layer_id, scale, kv)


class NotImportable(MyAttentionBackend):
    name = "notimportable"

    @classmethod
    def check(cls, spec):
        return super().check(spec) + ["module 'mykernels_ext' is not importable (pip install mykernels)"]


class Fp32Error(MyAttentionBackend):
    name = "fp32error"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        super().forward(q, k, v, out, layer_id, scale, kv)
        out.mul_(1 + 5e-5)


class Bf16Error(MyAttentionBackend):
    name = "bf16error"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        super().forward(q, k, v, out, layer_id, scale, kv)
        if out.dtype == torch.bfloat16:
            out.mul_(1 + 1e-2)


CORRECT = (TiledAttention,)
BROKEN = (AcceptsAnyHeadDim, NoKVWrite, IgnoresLayerId, IgnoresScale, StalePlan, NaNPaddedRows, NoPaddedKVWrite,
          SyncsInForward, NotImportable, Fp32Error, Bf16Error)


@hookimpl
def pieceworks_register_backends():
    return [*CORRECT, *BROKEN]
