"""The built-in backends, registered through the same hook as third-party plugins.

One plugin per family, so `plugins.disabled: [pieceworks.flashinfer]` removes a whole family. Backend
modules import their kernel libraries lazily, so listing them here keeps `import pieceworks` light.
"""

from __future__ import annotations

from pieceworks.backends.hookspecs import hookimpl


class TorchBackends:
    """Reference backends in plain torch: lowest priority, available everywhere, safe in every graph."""

    @hookimpl
    def pieceworks_register_backends(self):
        from pieceworks.backends.attention.torch import TorchAttentionBackend
        from pieceworks.backends.fp4_gemm.torch import TorchFp4GemmBackend
        from pieceworks.backends.mla.torch import TorchMLABackend
        from pieceworks.backends.moe.torch import TorchMoEBackend

        return [TorchAttentionBackend, TorchMLABackend, TorchFp4GemmBackend, TorchMoEBackend]


BUILTIN_PLUGINS: dict[str, object] = {
    "pieceworks.torch": TorchBackends(),
}
