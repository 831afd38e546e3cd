"""Forward modes, graph modes and the per-step batch description that attention backends plan from.

Token layout in every step: the new tokens of sequence 0, then those of sequence 1, ... (contiguous per
sequence, in batch order). Shapes below use T = number of new tokens in the step, B = number of
sequences, P = pages per sequence in the page table.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch


class ForwardMode(enum.Enum):
    """What a step does to its sequences."""

    EXTEND = "extend"  # new tokens after an optional cached prefix (prefill, chunked prefill)
    DECODE = "decode"  # exactly one new token per sequence, every sequence has a cached prefix
    MIXED = "mixed"  # some sequences extend, some decode, in one batch
    IDLE = "idle"  # no tokens (a tensor-parallel worker with nothing to do this step)

    @classmethod
    def classify(cls, extend_lens: list[int], prefix_lens: list[int]) -> "ForwardMode":
        """The mode of a batch from its per-sequence new-token counts and cached-prefix lengths."""
        if not extend_lens:
            return cls.IDLE
        decoding = [n == 1 and p > 0 for n, p in zip(extend_lens, prefix_lens)]
        if all(decoding):
            return cls.DECODE
        if any(decoding):
            return cls.MIXED
        return cls.EXTEND


class GraphMode(enum.Enum):
    """How a step's kernels are launched."""

    EAGER = "eager"  # plain Python dispatch
    FULL = "full"  # the whole forward replayed from one CUDA graph (decode)
    PIECEWISE = "piecewise"  # pieces between attention ops replayed from CUDA graphs (extend, mixed)


# Forward modes that a kernel table is resolved for (IDLE runs no kernels), and the graph modes each
# of them can run under.
TABLE_MODES: dict[ForwardMode, tuple[GraphMode, ...]] = {
    ForwardMode.EXTEND: (GraphMode.EAGER, GraphMode.PIECEWISE, GraphMode.FULL),
    ForwardMode.MIXED: (GraphMode.EAGER, GraphMode.PIECEWISE, GraphMode.FULL),
    ForwardMode.DECODE: (GraphMode.EAGER, GraphMode.FULL),
}


@dataclass
class StepMetadata:
    """Everything attention backends need to plan one step, built by the runner from the batch.

    Host-side lists are the truth; device tensors are copies for kernels. `num_tokens` counts real
    tokens; `slot_mapping` may be longer (padding to a graph size), its padded entries pointing at the
    pool's reserved slot so padded tokens write their KV somewhere harmless.

    Attributes:
        mode: the step's forward mode.
        graph_mode: how this step is launched (backends size static buffers by it).
        extend_lens: [B] new tokens per sequence.
        prefix_lens: [B] tokens already in the KV cache per sequence before this step.
        page_size: tokens per KV page.
        page_table: [B, P] int32 on the device: page ids of each sequence, in order; unused entries 0.
        slot_mapping: [T_padded] int64 on the device: KV slot (page * page_size + offset) of every token.
        positions: [T_padded] int64 on the device: position of every token in its sequence.
        graph_batch_size: for FULL decode graphs, the padded batch size of the graph being replayed
            (sequences past len(extend_lens) are padding with length-1 dummy entries); else None.
        page_lists: every planned sequence's pages as host lists (FULL decode: padding sequences
            included, each [reserved page]), where the runner has them; backends may plan from them
            instead of the device page table. Else None.
        extend_index: FULL extend graphs (executor/extend_graph.py): int32 [2 * graph_batch_size + 1] on the
            device at a fixed address, each sequence's query offsets (graph_batch_size + 1) then KV lengths,
            padding sequences empty; else None.
    """

    mode: ForwardMode
    graph_mode: GraphMode
    extend_lens: list[int]
    prefix_lens: list[int]
    page_size: int
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    graph_batch_size: int | None = None
    page_lists: list[list[int]] | None = None
    extend_index: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def seq_lens(self) -> list[int]:
        """[B] KV length of every sequence after this step (prefix + new tokens)."""
        return [p + n for p, n in zip(self.prefix_lens, self.extend_lens)]

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    def qo_indptr(self) -> list[int]:
        """[B + 1] offsets of each sequence's new tokens in the step's token layout."""
        out = [0]
        for n in self.extend_lens:
            out.append(out[-1] + n)
        return out

    def seq_lens_tensor(self) -> torch.Tensor:
        """[B] int32 on the device; cached per step."""
        if "seq_lens" not in self._cache:
            self._cache["seq_lens"] = torch.tensor(self.seq_lens, dtype=torch.int32, device=self.device)
        return self._cache["seq_lens"]


@dataclass(eq=False)
class Sequence:
    """A caller's handle on one sequence in the KV cache (from `Executor.new_sequence()`).

    Attributes:
        id: unique per executor.
        tokens: every token whose KV is in the cache, in order.
        pages: KV pages holding them, in order.
        freed: set by `Executor.free`; a freed handle can't be used again.
        block_keys: prefix-cache keys of the leading full pages (`pages[:len(block_keys)]`), chained
            page after page; the executor extends it as pages fill.
        num_cached_tokens: tokens the sequence started with from the prefix cache (shared pages).
    """

    id: int
    tokens: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    freed: bool = False
    block_keys: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def kv_len(self) -> int:
        return len(self.tokens)


@dataclass
class ForwardBatch:
    """One step's work: new tokens for each of some sequences.

    Attributes:
        seqs: the sequences, each at most once.
        tokens: new token ids per sequence (a list of ints or a 1-D integer tensor each).
        return_all_logits: return logits for every new token (scoring), not only each sequence's last;
            a list of one bool per sequence: for every new token of the sequences where True.
    """

    seqs: list[Sequence]
    tokens: list[list[int]]
    return_all_logits: bool | list[bool] = False

    @property
    def mode(self) -> ForwardMode:
        return ForwardMode.classify([len(t) for t in self.tokens], [s.kv_len for s in self.seqs])


def extend_index(extend_lens: list[int], kv_lens: list[int], num_seqs: int) -> torch.Tensor:
    """`StepMetadata.extend_index`'s values (int32, on the host) for sequences of `extend_lens` new tokens and
    `kv_lens` KV lengths after the step, padded with empty sequences to `num_seqs`."""
    pad = num_seqs - len(extend_lens)
    qo = [0, *itertools.accumulate(extend_lens)]
    return torch.tensor(qo + [qo[-1]] * pad + list(kv_lens) + [0] * pad, dtype=torch.int32)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, asynchronously (torch's caching host
    allocator keeps the pinned block until the copy has run, so the caller may drop `t`)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def mark_replayed(t: torch.Tensor) -> torch.Tensor:
    """Mark `t` as a captured CUDA graph's output: the piecewise runner hands the same tensor object, at
    the same address, to every step of its capture size (see `is_replayed`)."""
    t.pieceworks_replayed = True
    return t


def is_replayed(t: torch.Tensor) -> bool:
    """Whether `t` is a graph output marked by `mark_replayed`. A backend may keep views of such a tensor
    from one step to the next (they hold no memory of their own); any other tensor is fresh and views
    kept of it would keep its memory allocated."""
    return getattr(t, "pieceworks_replayed", False)
