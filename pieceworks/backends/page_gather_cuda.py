"""FlashInfer's paged-KV page indices gathered on the GPU from the step's device page table (NVRTC).

A FlashInfer prefill plan sends the page ids of every sequence, concatenated, to the device. Built on the host
they cost about 17 ns a page (numpy over Python lists: 0.29 ms for 16,207 pages, a 256-token chunk and 63 sequences
of 4,097 tokens in pages of 16, on the CPU machine: `exp/page-gather-probe`'s probe_fastplan_cpu.py), on the critical
path of every extend and mixed step. The step's page table is on the device
already (`inputs.step_inputs` copies it with the token rows), so a plan of many pages sends only the CSR offsets
and lets one kernel copy each sequence's first pages into place: a launch, whatever the pages. The plan of a
256-token chunk with 63 decode rows over 4,096 tokens (16,144 pages) took 114 us of host time against 466 with
the host's indices, 134 against 158 with 32 rows over 512 tokens (1,040 pages; H100 2026-12-06, alternated,
`exp/page-gather-probe`). Imports torch only.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from pieceworks.backends import nvrtc

SOURCE = r"""
// indices[indptr[b] + j] = table[b * width + j] for j < indptr[b + 1] - indptr[b]; one CTA per sequence.
__global__ void pw_gather_pages(int* indices, const int* table, const int* indptr, int width)
{
    const int b = blockIdx.x, start = indptr[b], n = indptr[b + 1] - start;
    const int* row = table + (long long)b * width;
    for (int j = threadIdx.x; j < n; j += blockDim.x) indices[start + j] = row[j];
}
"""

# Below this many pages the host builds the indices (numpy is cheaper than a launch there).
MIN_PAGES = 256
THREADS = 128


@lru_cache(maxsize=None)
def unavailable(device: torch.device) -> str | None:
    """Why the kernel can't run on `device`, or None."""
    if device.type != "cuda":
        return "needs a CUDA device"
    return nvrtc.unavailable_reason()


class PageGather:
    """Launches of the gather for one batch size into fixed device views (the plan's index buffer and its kv
    indptr), packed once; each step passes its page table."""

    def __init__(self, indices: torch.Tensor, indptr: torch.Tensor) -> None:
        kernel = nvrtc.kernel(SOURCE, "pw_gather_pages", indices.device)
        b = indptr.shape[0] - 1
        # the table (argument 1) and its row stride (3) are each step's: placeholders until the first call
        self.launch = kernel.bind((b, 1, 1), (THREADS, 1, 1), [indices, indices, indptr, 0], pdl=False)

    def __call__(self, table: torch.Tensor, stream: int | None = None) -> None:
        """Gather from `table` (int32 [b, width] with unit inner stride, on the device, written in stream order);
        on raw `stream` when given (the caller's device current)."""
        self.launch.params[3].value = table.stride(0)
        if stream is None:
            self.launch(1, table)
        else:
            self.launch.on(stream, 1, table)


def usable(table: torch.Tensor | None, num_seqs: int, max_count: int, total_pages: int) -> bool:
    """Whether a plan of `num_seqs` sequences and `total_pages` pages (at most `max_count` in one) gathers its
    indices from `table` on the device: enough pages to pay for a launch, and a table whose rows are the
    sequences (int32, unit inner stride, wide enough)."""
    return (table is not None and total_pages >= MIN_PAGES and table.dtype == torch.int32 and table.dim() == 2
            and table.shape[0] == num_seqs and table.shape[1] >= max_count and table.stride(1) == 1
            and unavailable(table.device) is None)


__all__ = ["PageGather", "usable", "unavailable", "MIN_PAGES"]
