"""Run by tests/test_greedy_kernel.py in a subprocess with TRITON_INTERPRET=1 (Triton's CPU interpreter fixes
its mode when a kernel is decorated): `greedy_kernel.greedy_token_ids` on CPU logits against argmax / isfinite,
over batch sizes and vocabularies that give one or many chunks per row, a chunk ending mid-block, ties across
and inside blocks and chunks, NaN, +inf and -inf. Prints one JSON line: the cases run and the mismatches.
"""

from __future__ import annotations

import json
import math
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton_interp_numpy  # noqa: E402, F401  (beside this script: the interpreter under NumPy >= 2.3)

from pieceworks.executor import greedy_kernel as G  # noqa: E402


def reference(logits: torch.Tensor) -> list[int]:
    return torch.where(torch.isfinite(logits).all(-1), logits.argmax(-1), -1).tolist()


def cases():
    gen = torch.Generator().manual_seed(5)
    for rows, vocab in ((1, 1), (1, 7), (3, 1000), (1, 5000), (2, 70001), (1, 128256), (33, 2048), (20, 3000)):
        x = torch.randn(rows, vocab, generator=gen)
        yield rows, vocab, "plain", x
        x = torch.randint(-3, 3, (rows, vocab), generator=gen).float()  # many ties
        yield rows, vocab, "ties", x
        if vocab >= 7:
            x = torch.randn(rows, vocab, generator=gen)
            x[0, vocab // 2] = math.nan
            x[-1, vocab - 1] = -math.inf
            if rows > 2:
                x[1, 0] = math.inf
            top = x.nan_to_num(neginf=0, posinf=0).max() + 1
            x[rows // 2, vocab - 1] = x[rows // 2, min(vocab - 1, G.BLOCK)] = top  # tie across blocks / chunks
            yield rows, vocab, "nonfinite", x


def main() -> None:
    run, bad = 0, []
    target = G.TARGET_PROGRAMS
    for rows, vocab, kind, x in cases():
        # 20 rows with 16 programs as the target: one chunk of three blocks per row, as a batch of 264 rows or more
        # gets, at 20 programs instead of 300 (the interpreter's time goes by programs x blocks: 1 s against 13)
        G.TARGET_PROGRAMS = 16 if rows == 20 else target
        got = G.greedy_token_ids(x).tolist()
        want = reference(x)
        run += 1
        if rows == 20:
            assert G.chunking(rows, vocab) == (3072, 1)
        if got != want:
            bad.append({"rows": rows, "vocab": vocab, "kind": kind, "chunking": G.chunking(rows, vocab),
                        "first": next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)})
    print(json.dumps({"cases": run, "mismatches": bad}))


if __name__ == "__main__":
    main()
