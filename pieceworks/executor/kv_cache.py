"""Paged KV pools (GQA pages and MLA latent pages) and their page allocator.

A slot is `page * page_size + offset`. Page 0 is reserved: padded tokens of a graph-sized step write
their KV there, so it is never handed to a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pieceworks.errors import ConfigError, OutOfPages

RESERVED_PAGE = 0
DEFAULT_PAGE_SIZE = 16  # kv_cache.page_size's default, named in messages
CPU_DEFAULT_MAX_TOKENS = 16384  # without kv_cache.num_tokens, a CPU pool stays this small


class PageAllocator:
    """Free-list allocator over pages 1..num_pages-1; all-or-nothing allocation."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (1 reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, RESERVED_PAGE, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages a sequence may ever hold (all but the reserved one)."""
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} free of {self.capacity}")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        bad = [p for p in pages if p not in self._used]
        if bad:
            raise ValueError(f"pages {bad} are not allocated (freed twice?)")
        self._used.difference_update(pages)
        self._free.extend(reversed(pages))


@dataclass(frozen=True)
class KVLayout:
    """Per-token KV shape: GQA (num_kv_heads, head_dim) for K and V, or MLA (latent_dim,) once."""

    kind: str  # "gqa" or "mla"
    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0  # kv_lora_rank + qk_rope_head_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        per_layer = 2 * self.num_kv_heads * self.head_dim if self.kind == "gqa" else self.latent_dim
        return per_layer * self.num_layers * size


class KVPool:
    """KV storage for every layer plus the page allocator.

    GQA: `k_cache(l)`, `v_cache(l)`: [num_pages, page_size, num_kv_heads, head_dim].
    MLA: `latent_cache(l)`: [num_pages, page_size, kv_lora_rank + rope_dim].
    """

    def __init__(
        self, layout: KVLayout, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.layout = layout
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.device = torch.device(device)
        self.allocator = PageAllocator(num_pages)
        if layout.kind == "gqa":
            shape = (layout.num_layers, 2, num_pages, page_size, layout.num_kv_heads, layout.head_dim)
        elif layout.kind == "mla":
            shape = (layout.num_layers, num_pages, page_size, layout.latent_dim)
        else:
            raise ValueError(f"unknown KV layout kind {layout.kind!r}")
        self.buffer = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def reserved_slot(self) -> int:
        return RESERVED_PAGE * self.page_size

    @property
    def num_tokens(self) -> int:
        """Tokens the pool can hold for sequences (the reserved page excluded)."""
        return self.allocator.capacity * self.page_size

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]

    def latent_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[layer]

    @classmethod
    def sized(
        cls,
        layout: KVLayout,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_tokens: int | None,
        memory_fraction: float,
    ) -> "KVPool":
        """A pool of `num_tokens` tokens, or of `memory_fraction` of the free memory when None."""
        if num_tokens is not None and page_size > num_tokens:
            raise ConfigError(f"kv_cache.page_size: {page_size} exceeds kv_cache.num_tokens={num_tokens}; use a "
                              "page size of a few tokens (16 is the default)")
        if num_tokens is None:
            per_token = layout.bytes_per_token(dtype)
            free = _free_bytes(torch.device(device))
            num_tokens = int(free * memory_fraction) // per_token
            if torch.device(device).type == "cpu":
                num_tokens = min(num_tokens, CPU_DEFAULT_MAX_TOKENS)
            if num_tokens < 2 * page_size and num_tokens >= 2 * DEFAULT_PAGE_SIZE:
                raise ConfigError(
                    f"kv_cache.page_size: {page_size} is too large: a pool needs 2 pages (one is reserved), "
                    f"{2 * page_size} tokens, but it holds {num_tokens} here; use a page size of a few tokens "
                    f"({DEFAULT_PAGE_SIZE} is the default)"
                )
            if num_tokens < 2 * page_size:
                raise ValueError(
                    f"kv_cache: only {free / 2**30:.2f} GiB free; {memory_fraction:.0%} of it holds "
                    f"{num_tokens} tokens at {per_token} bytes each. Lower the model size or set "
                    "kv_cache.num_tokens"
                )
        num_pages = -(-num_tokens // page_size) + 1  # + the reserved page
        return cls(layout, num_pages, page_size, dtype, device)


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
