"""Paged KV pools (GQA pages and MLA latent pages) and their page allocator.

A slot is `page * page_size + offset`. Page 0 is reserved: padded tokens of a graph-sized step write
their KV there, so it is never handed to a sequence. Pages are refcounted: with prefix caching, a full
page may be held read-only by several sequences that share its prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from pieceworks.core.devices import free_bytes
from pieceworks.core.kv import KV_FP8, KVLayout
from pieceworks.errors import BatchError, ConfigError, OutOfPages

RESERVED_PAGE = 0
DEFAULT_PAGE_SIZE = 16  # kv_cache.page_size's default, named in messages
CPU_DEFAULT_MAX_TOKENS = 16384  # without kv_cache.num_tokens, a CPU pool stays this small


class PageAllocator:
    """Refcounted pages 1..num_pages-1 with an optional prefix cache; all-or-nothing allocation.

    A page is free, held (refcount >= 1), or cached and unreferenced. Full pages can be registered
    under a block key (`block_key`: a hash chained over the page's tokens and its parent page's key,
    as vLLM keys its blocks), so a later sequence with the same prefix takes them read-only instead of
    recomputing them. A cached page whose refcount drops to 0 keeps its KV and its key until `alloc`
    needs the page: such pages are evicted least recently used first, and only when the free list is
    empty. `num_free` counts them, since they can be handed out.
    """

    def __init__(self, num_pages: int, prefix_caching: bool = False) -> None:
        if num_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (1 reserved), got {num_pages}")
        self.num_pages = num_pages
        self.prefix_caching = prefix_caching
        self._free = list(range(num_pages - 1, RESERVED_PAGE, -1))  # pop() hands out low ids first
        self._ref = [0] * num_pages
        self._key_of: dict[int, bytes] = {}  # cached page -> its block key
        self._page_of: dict[bytes, int] = {}  # block key -> cached page
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0, LRU first
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Pages `alloc` can hand out: free ones plus unreferenced cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages held by at least one sequence."""
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages registered in the prefix cache (held or not)."""
        return len(self._key_of)

    @property
    def capacity(self) -> int:
        """Pages a sequence may ever hold (all but the reserved one)."""
        return self.num_pages - 1

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def alloc(self, n: int) -> list[int]:
        """`n` pages with refcount 1, from the free list, then by evicting cached pages (LRU).

        Raises:
            OutOfPages: fewer than `n` pages can be handed out; nothing was taken.
        """
        if n > self.num_free:
            raise OutOfPages(f"need {n} KV pages, {self.num_free} free of {self.capacity}")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
                self.num_evicted += 1
            self._ref[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page nobody holds becomes free, or evictable when cached.

        Raises:
            ValueError: a page is not held (freed twice?); nothing was changed.
        """
        bad = [p for p in pages if not 0 < p < self.num_pages or self._ref[p] < 1]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"pages {bad or pages} are not allocated (freed twice?)")
        for page in reversed(pages):  # a sequence's last pages are the least likely to be shared
            self._ref[page] -= 1
            if self._ref[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, tokens: list[int], page_size: int) -> tuple[list[int], list[bytes]]:
        """The cached pages holding the longest prefix of `tokens`' full pages, and their block keys (the
        pages not taken: see `share`). A page's key is hashed only if every page before it hit: a prompt
        that shares nothing costs one hash."""
        pages: list[int] = []
        keys: list[bytes] = []
        for key in iter_block_keys(tokens, page_size):
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
        return pages, keys

    def share(self, pages: list[int]) -> None:
        """Take one more reference to each cached page (found by `lookup`)."""
        for page in pages:
            assert page in self._key_of, f"page {page} is not in the prefix cache"
            if self._ref[page] == 0:
                del self._evictable[page]
            self._ref[page] += 1

    def register(self, page: int, key: bytes) -> None:
        """Record a held, full page under its block key. A key already cached keeps its page (the new
        page stays private and is freed normally)."""
        assert self._ref[page] >= 1, f"page {page} is not held"
        if self.prefix_caching and key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key

    def unregister(self, page: int) -> None:
        """Take a held page out of the prefix cache (its KV is about to be overwritten: a sequence cut back
        into it, `Executor.truncate`). Only its one holder may: nobody else reads what it will hold."""
        assert self._ref[page] == 1, f"page {page} is held {self._ref[page]} times"
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._page_of[key]


def truncate_sequence(alloc: PageAllocator, seq, num_tokens: int, page_size: int) -> bool:
    """Keep the KV of `seq`'s first `num_tokens` tokens (`Executor.truncate`, which checked that `seq` is live): the
    pages past them go back to the allocator (cached ones stay cached: their KV is a valid continuation of their
    prefix), a kept page that was full leaves the prefix cache, and `tokens` and `block_keys` shrink to match.
    Returns whether pages went back.

    Raises:
        BatchError: `num_tokens` outside [0, kv_len], or a cut inside a page another sequence shares; nothing changed.
    """
    if type(num_tokens) is not int or not 0 <= num_tokens <= seq.kv_len:
        raise BatchError(f"truncate(seq {seq.id}, {num_tokens!r}): num_tokens must be an int in [0, {seq.kv_len}] "
                         "(the sequence's kv_len)")
    full, keep_pages = num_tokens // page_size, -(-num_tokens // page_size)
    if full < keep_pages and num_tokens < seq.kv_len and alloc.refcount(seq.pages[full]) > 1:
        raise BatchError(f"truncate(seq {seq.id}, {num_tokens}): page {full} of the sequence is shared with another "
                         f"sequence (prefix cache); cut at a multiple of {page_size}")
    dropped = seq.pages[keep_pages:]
    if full < keep_pages and full < len(seq.block_keys):  # the kept partial page was registered full
        alloc.unregister(seq.pages[full])
    del seq.pages[keep_pages:], seq.tokens[num_tokens:], seq.block_keys[full:]
    if dropped:
        alloc.free(dropped)
    return bool(dropped)


def reserve_pages(alloc: PageAllocator, page_size: int, seqs: list, tokens: list[list[int]]) -> list[list[int]]:
    """Allocate the pages a step feeding `tokens[i]` to `seqs[i]` needs, appended to each sequence's pages; returns
    each sequence's new pages (for `release_pages` should the step fail).

    Raises:
        OutOfPages: too few free pages; nothing was taken.
    """
    need = [max(0, -(-(s.kv_len + len(t)) // page_size) - len(s.pages)) for s, t in zip(seqs, tokens)]
    if sum(need) > alloc.num_free:
        raise OutOfPages(
            f"the batch needs {sum(need)} more KV pages ({sum(need) * page_size} tokens) but only "
            f"{alloc.num_free} are free: run fewer sequences per step, free finished ones, "
            "or enlarge kv_cache.num_tokens"
        )
    new: list[list[int]] = [[] for _ in seqs]
    try:  # an interrupt between two allocations gives back what the earlier ones took
        for i, (seq, n) in enumerate(zip(seqs, need)):
            if n:
                new[i] = alloc.alloc(n)
                seq.pages.extend(new[i])
    except BaseException:
        release_pages(alloc, seqs, new)
        raise
    return new


def release_pages(alloc: PageAllocator, seqs: list, new_pages: list[list[int]]) -> None:
    """Give back the pages `reserve_pages` took for a step that failed."""
    for seq, pages in zip(seqs, new_pages):
        if pages:
            if seq.pages[len(seq.pages) - len(pages):] == pages:
                del seq.pages[len(seq.pages) - len(pages):]
            alloc.free(pages)


def block_key(parent: bytes | None, tokens: list[int]) -> bytes:
    """The prefix-cache key of a full page: a 128-bit hash of the parent page's key and the page's
    token ids, so equal keys mean equal whole prefixes (up to hash collisions at 2**-128)."""
    return _key(parent, array("q", tokens).tobytes())


def _key(parent: bytes | None, page: bytes) -> bytes:
    """`block_key` of a page's token ids as int64 bytes."""
    return hashlib.blake2b(parent + page if parent else page, digest_size=16).digest()


def iter_block_keys(tokens: list[int], page_size: int, parent: bytes | None = None, start_page: int = 0):
    """Keys of the full pages of `tokens` from page `start_page` on, chained from `parent` (the key
    of page start_page - 1), each hashed when asked for (`block_key`'s keys; the token ids are
    turned into bytes once, not per page: the 125 keys of a 2,000-token prefix: 136-148 -> 119-124 us on the
    CPU machine)."""
    end = len(tokens) // page_size
    if end <= start_page:
        return
    data = memoryview(array("q", tokens[start_page * page_size : end * page_size]).tobytes())
    width = 8 * page_size
    for at in range(0, len(data), width):
        parent = _key(parent, data[at : at + width])
        yield parent


def block_keys(tokens: list[int], page_size: int, parent: bytes | None = None,
               start_page: int = 0) -> list[bytes]:
    """`iter_block_keys` as a list."""
    return list(iter_block_keys(tokens, page_size, parent, start_page))


class KVPool:
    """KV storage for every layer plus the page allocator.

    GQA: `k_cache(l)`, `v_cache(l)`: [num_pages, page_size, num_kv_heads, head_dim].
    MLA: `latent_cache(l)`: [num_pages, page_size, kv_lora_rank + rope_dim].
    An FP8 pool (`dtype` float8_e4m3fn) stores K / scale and V / scale, one pair of float scales per layer
    (`k_scale(l)`, `v_scale(l)`; `scales` [(k, v)] per layer, all 1.0 when None): backends quantize what they
    write (`core.kv.quantize_kv`) and multiply what they read by the scale.
    """

    def __init__(
        self, layout: KVLayout, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device,
        prefix_caching: bool = False, scales: list[tuple[float, float]] | None = None,
    ) -> None:
        self.layout = layout
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.scales = [(1.0, 1.0)] * layout.num_layers if scales is None else [(float(k), float(v)) for k, v in scales]
        if len(self.scales) != layout.num_layers:
            raise ValueError(f"{len(self.scales)} KV scale pairs for {layout.num_layers} layers")
        self.device = torch.device(device)
        self.allocator = PageAllocator(num_pages, prefix_caching)
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

    @property
    def fp8(self) -> bool:
        """Whether the pool stores K/V as e4m3 with per-layer scales."""
        return self.dtype == KV_FP8

    def k_scale(self, layer: int) -> float:
        """What a stored key of `layer` is multiplied by when read (1.0 unless the pool is FP8)."""
        return self.scales[layer][0]

    def v_scale(self, layer: int) -> float:
        """What a stored value of `layer` is multiplied by when read (1.0 unless the pool is FP8)."""
        return self.scales[layer][1]

    @classmethod
    def sized(
        cls,
        layout: KVLayout,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_tokens: int | None,
        memory_fraction: float,
        prefix_caching: bool = False,
        scales: list[tuple[float, float]] | None = None,
    ) -> "KVPool":
        """A pool of `num_tokens` tokens, or of `memory_fraction` of the free memory when None."""
        if num_tokens is not None and page_size > num_tokens:
            raise ConfigError(f"kv_cache.page_size: {page_size} exceeds kv_cache.num_tokens={num_tokens}; use a "
                              "page size of a few tokens (16 is the default)")
        per_token = layout.bytes_per_token(dtype)
        if num_tokens is not None:
            free = free_bytes(torch.device(device), unknown=None)
            if free is not None and num_tokens * per_token > free:
                raise ConfigError(f"kv_cache.num_tokens: {num_tokens} tokens take {num_tokens * per_token / 2**30:.2f} "
                                  f"GiB at {per_token} bytes each, but {free / 2**30:.2f} GiB are free on {device}; "
                                  "lower it, or leave it unset for kv_cache.memory_fraction of the free memory")
        else:
            free = free_bytes(torch.device(device))
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
                    f"kv_cache: only {free / 2**30:.2f} GiB free; kv_cache.memory_fraction={memory_fraction:g} of it "
                    f"holds {num_tokens} tokens at {per_token} bytes each, fewer than 2 pages. Raise memory_fraction, "
                    "lower the model size or set kv_cache.num_tokens"
                )
        num_pages = -(-num_tokens // page_size) + 1  # + the reserved page
        return cls(layout, num_pages, page_size, dtype, device, prefix_caching, scales)

