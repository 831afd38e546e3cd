"""The server's /metrics in Prometheus' text exposition format (version 0.0.4).

Gauges come from `AsyncEngine.stats()` at scrape time; the histograms and counters are kept here, fed
by the request handlers. The format is written directly (a few dozen lines) so the server needs no
metrics library; tests parse it with prometheus_client's parser.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; vLLM's bucket edges for the same two histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
PREFIX = "pieceworks_"
FINISH_REASONS = ("stop", "length", "abort", "error")  # the engine's; request_success_total has a series for each


@dataclass
class Histogram:
    """A cumulative histogram with fixed upper bounds (the +Inf bucket is implicit)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            running += n
            le = "+Inf" if bound == math.inf else repr(float(bound))
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out += [f"{name}_sum {self.total!r}", f"{name}_count {self.count}"]
        return out


@dataclass
class ServerMetrics:
    """What the handlers record: per-request latencies, token counts, finish reasons, rejections."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)
    rejected: int = 0
    bad_requests: int = 0

    def render(self, stats: dict) -> str:
        """The exposition text for the engine's `stats()` and what was recorded here."""
        hit, queried = stats.get("prefix_cache_hit_tokens", 0), stats.get("prefix_cache_queried_tokens", 0)
        used, total = stats.get("kv_pages_used", 0), stats.get("kv_pages_total", 0)
        out: list[str] = []

        def metric(name: str, kind: str, doc: str, samples: list[str]) -> None:
            out.extend([f"# HELP {PREFIX}{name} {doc}", f"# TYPE {PREFIX}{name} {kind}", *samples])

        def one(name: str, kind: str, doc: str, value: float) -> None:
            metric(name, kind, doc, [f"{PREFIX}{name} {value!r}"])

        # Counters carry `_total` in their HELP/TYPE names too, as prometheus_client writes them.
        one("num_requests_running", "gauge", "Requests the engine is running (prefill or decode).",
            stats.get("running", 0))
        one("num_requests_waiting", "gauge", "Requests waiting for admission.", stats.get("waiting", 0))
        one("kv_pages_used", "gauge", "KV-cache pages held by requests.", used)
        one("kv_pages_total", "gauge", "KV-cache pages in the pool.", total)
        one("kv_pages_cached", "gauge", "Pages no request holds, kept for prefix-cache hits (evicted on demand).",
            stats.get("kv_pages_cached", 0))
        one("kv_cache_usage_ratio", "gauge", "Fraction of the KV pool's pages in use.", used / total if total else 0.0)
        one("prefix_cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache / prompt tokens queried.",
            hit / queried if queried else 0.0)
        one("prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.", hit)
        one("prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.", queried)
        one("num_preemptions_total", "counter", "Requests preempted (recomputed) under KV pressure.",
            stats.get("num_preemptions", 0))
        one("engine_generated_tokens_total", "counter", "Tokens the engine generated, aborted requests included.",
            stats.get("num_generated_tokens", 0))
        one("spec_decode_num_draft_tokens_total", "counter", "Draft tokens fed (speculative decoding).",
            stats.get("num_draft_tokens", 0))
        one("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted (speculative decoding).",
            stats.get("num_accepted_tokens", 0))
        one("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens)
        one("generation_tokens_total", "counter", "Tokens generated by finished requests.", self.generation_tokens)
        one("requests_rejected_total", "counter", "Requests refused with 503 because the queue was full.",
            self.rejected)
        one("requests_bad_total", "counter", "Requests refused with 400.", self.bad_requests)
        # every reason from the start, at 0 until one is seen: a series that first appears with a count of 1 loses
        # that count to rate() and increase()
        reasons = sorted(set(FINISH_REASONS) | set(self.finished))
        metric("request_success_total", "counter", "Finished requests by finish reason.",
               [f'{PREFIX}request_success_total{{finished_reason="{r}"}} {self.finished[r]}' for r in reasons])
        metric("time_to_first_token_seconds", "histogram", "Time from arrival to the first generated token.",
               self.ttft.lines(f"{PREFIX}time_to_first_token_seconds"))
        metric("time_per_output_token_seconds", "histogram", "Mean time per generated token after the first.",
               self.tpot.lines(f"{PREFIX}time_per_output_token_seconds"))
        metric("e2e_request_latency_seconds", "histogram", "Time from arrival to the last token.",
               self.e2e.lines(f"{PREFIX}e2e_request_latency_seconds"))
        return "\n".join(out) + "\n"
