"""Serving-benchmark statistics: per-request timings in, TTFT / TPOT / ITL / E2E percentiles and
throughput out, as a table and as JSON.

Shared by `pieceworks bench` (HTTP or in-process) and `benchmarks/serving.py`; it needs numpy only.
Definitions (vLLM's benchmark_serving.py uses the same): TTFT = first output - send; ITL = the gaps
between consecutive outputs of a request (one per streamed chunk); TPOT = (last - first output) /
(output tokens - 1), over requests with at least two tokens; E2E = last output - send.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request's timings (time.perf_counter() seconds) and token counts."""

    prompt_tokens: int
    start: float
    chunk_times: list[float] = field(default_factory=list)  # when each output with new tokens arrived
    output_tokens: int = 0
    end: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and self.output_tokens > 0

    def add_chunk(self, t: float, num_tokens: int) -> None:
        if num_tokens:
            self.chunk_times.append(t)
            self.output_tokens += num_tokens

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.start


def distribution(values: list[float], scale: float = 1e3) -> dict[str, float]:
    """mean, p50/p90/p99 of `values` times `scale` (seconds -> ms by default); NaN when empty."""
    if not values:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def summarize(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    """The benchmark's result as plain data (what `--result-json` writes)."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else math.nan,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else math.nan,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s > 0 else math.nan,
        "ttft_ms": distribution([r.ttft for r in ok]),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": distribution([x for r in ok for x in r.itls]),
        "e2e_ms": distribution([r.e2e for r in ok]),
    }


def format_table(summary: dict[str, Any], title: str = "Serving benchmark") -> str:
    """A fixed-width text table of `summarize`'s result (80 columns)."""
    rows = [
        ("Successful requests", f"{summary['completed']}"),
        ("Failed requests", f"{summary['failed']}"),
        ("Duration (s)", f"{summary['duration_s']:.2f}"),
        ("Input tokens", f"{summary['total_input_tokens']}"),
        ("Output tokens", f"{summary['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]
    width = 50
    lines = [f"{' ' + title + ' ':=^{width}}"]
    lines += [f"{k:<36}{v:>{width - 36}}" for k, v in rows]
    head = f"{'(ms)':<14}" + "".join(f"{c:>9}" for c in ("mean", *(f"p{p}" for p in PERCENTILES)))
    lines += [f"{'':-^{width}}", head]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")):
        d = summary[key]
        lines.append(f"{label:<14}" + "".join(f"{d[c]:>9.2f}" for c in ("mean", *(f"p{p}" for p in PERCENTILES))))
    lines.append("=" * width)
    for e in summary.get("errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)
