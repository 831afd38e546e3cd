"""benchmarks/graphs.py's report: its tables in markdown, and the extend rows checked against the targets of
docs/benchmarks.md's status table for piecewise and full extend graphs."""

from __future__ import annotations

from common import md_table

TOKENS_ABSOLUTE = 256  # up to this many tokens a graph may trail the whole graph by GAP_MS; beyond, by GAP_SHARE
GAP_MS, GAP_SHARE = 0.5, 0.03
EAGER_OVER_PLAIN_AT_16 = 1.5


def _tokens(row: dict) -> int:
    """A row's token count: T, or a mixed row's padded size (its chunk + decode rows, rounded to a graph size)."""
    return row["T"] if isinstance(row["T"], int) else row["padded_to"]


def _gap_check(label: str, pairs: list[tuple[int, float, float]]) -> str:
    """pairs: (tokens, time - whole graph's time, the whole graph's time), both in ms."""
    pairs = [p for p in pairs if p[1] == p[1]]  # a NaN: the run did not time that row
    if not pairs:
        return f"- {label}: not measured"
    ok = all(gap <= (GAP_MS if n <= TOKENS_ABSOLUTE else GAP_SHARE * base) for n, gap, base in pairs)
    said = ", ".join(f"{n}: {gap:.2f} ms" if n <= TOKENS_ABSOLUTE else f"{n}: {100 * gap / base:.1f}%"
                     for n, gap, base in pairs)
    return f"- {label}: {'yes' if ok else 'no'} ({said})"


def targets(ext: list[dict]) -> list[str]:
    """The extend rows against the targets: piecewise within 0.5 ms of the whole-forward graph at T <= 256 and within
    3% beyond (piecewise timed in alternation with eager, and back to back like the whole graph), the full extend
    graphs the same against the whole graph + logits, eager within 1.5x plain torch at T = 16, piecewise never slower
    than eager. A target whose rows the run lacks reads "not measured"."""
    nan = float("nan")
    pw = [r for r in ext if "piecewise_ms" in r and "whole_graph_ms" in r]
    lines = [_gap_check("piecewise - whole graph <= 0.5 ms at T <= 256, <= 3% beyond (alternated)",
                        [(_tokens(r), r["piecewise_ms"] - r["whole_graph_ms"], r["whole_graph_ms"]) for r in pw]),
             _gap_check("the same, back to back",
                        [(_tokens(r), r.get("piecewise_b2b_ms", nan) - r["whole_graph_ms"], r["whole_graph_ms"])
                         for r in pw]),
             _gap_check("extend graph - whole graph + logits, back to back",
                        [(_tokens(r), r["extend_graph_b2b_ms"] - r["whole_logits_ms"], r["whole_logits_ms"])
                         for r in ext if "extend_graph_b2b_ms" in r])]
    at16 = max((r["eager_ms"] / r["plain_ms"] for r in ext if r["T"] == 16 and "plain_ms" in r), default=None)
    lines.append(f"- eager <= {EAGER_OVER_PLAIN_AT_16}x plain torch at T = 16: " +
                 (f"{'yes' if at16 <= EAGER_OVER_PLAIN_AT_16 else 'no'} ({at16:.2f}x)" if at16 else "not measured"))
    ratios = [(_tokens(r), r["piecewise_ms"] / r["eager_ms"]) for r in ext if "piecewise_ms" in r]
    lines.append("- piecewise never slower than eager: " + (
        f"{'yes' if all(x <= 1 for _, x in ratios) else 'no'} (at most {max(x for _, x in ratios):.3f}x eager)"
        if ratios else "not measured"))
    return ["Targets (docs/benchmarks.md, Status):", *lines]


def render(info: dict, ext: list[dict], dec: list[dict]) -> str:
    lines = [f"{info['date']} on {info['device']} (torch {info['torch']}); backends {info['backends']}", ""]
    nan = float("nan")
    if info["piecewise"]:
        pw = info["piecewise"]
        lines.append(f"piecewise: {len(pw['sizes'])} sizes up to {pw['max_tokens']}, {pw['pieces']} pieces "
                     f"({pw['unique_pieces']} distinct), {pw['graphs']} graphs; compile {pw['compile_s']:.1f} s, "
                     f"capture {pw.get('capture_s', float('nan')):.1f} s, pool {pw.get('pool_bytes', 0) / 2**30:.2f} GiB")
    if info["decode_graphs"]:
        d = info["decode_graphs"]
        lines.append(f"decode graphs: {len(d['batch_sizes'])} batch sizes, capture {d['capture_s']:.1f} s, "
                     f"pool {d['pool_bytes'] / 2**30:.2f} GiB")
    if ext:
        rows = []
        for r in ext:
            pw = f"{r['piecewise_ms']:.3f} ({r['padded_to']})" if "piecewise_ms" in r else "eager (above max_tokens)"
            kept = f"{100 * r['kept_of_saving']:.0f}%" if "kept_of_saving" in r else "-"
            ratio = f"{r['piecewise_vs_eager']:.3f}" if "piecewise_vs_eager" in r else "-"
            plain = (f"{r['plain_ms']:.3f} ({r['eager_ms'] / r['plain_ms']:.2f}x; max diff {r['plain_diff']:.2g})"
                     if "plain_ms" in r else "-")
            b2b = r.get("piecewise_b2b_ms", nan) - r.get("whole_graph_ms", nan)
            gpu = r.get("piecewise_gpu_ms", nan) - r.get("whole_gpu_ms", nan)
            plan = f"{r['plan_us']:.0f}" if "plan_us" in r else "-"
            rows.append([r["T"], f"{r['eager_ms']:.3f}", plain, pw, f"{r.get('whole_graph_ms', nan):.3f}",
                         f"{b2b:.3f}", f"{gpu:.3f}", plan, kept, ratio])
        lines += ["", md_table(["T", "eager ms", "plain-torch ms (eager / plain; max diff)", "piecewise ms (padded to)",
                                "whole graph ms", "piecewise - whole, both back to back (ms)",
                                "piecewise - whole, GPU time with the host ahead (ms)",
                                "piecewise step's attention plan, host us", "piecewise kept of the graph saving",
                                "piecewise / eager"], rows, "l" * 10)]
        full = [r for r in ext if "extend_graph_b2b_ms" in r]
        if full:  # executor/extend_graph.py: steps with their last tokens' logits, back to back, by GPU time, host us
            lines += ["", md_table(["T", "piecewise + logits ms", "extend graph ms", "whole graph + logits ms",
                                    "piecewise - whole (ms)", "extend graph - whole (ms)",
                                    "extend graph - whole, GPU time with the host ahead (ms)",
                                    "host us of the call: extend graph / whole graph replay"],
                                   [[r["T"], *(f"{r[k]:.3f}" for k in ("piecewise_logits_b2b_ms", "extend_graph_b2b_ms",
                                                                        "whole_logits_ms")),
                                     f"{r['piecewise_logits_b2b_ms'] - r['whole_logits_ms']:.3f}",
                                     f"{r['extend_graph_b2b_ms'] - r['whole_logits_ms']:.3f}",
                                     f"{r.get('extend_graph_gpu_ms', nan) - r.get('whole_logits_gpu_ms', nan):.3f}",
                                     " / ".join(f"{r.get(k, nan):.0f}" for k in ("extend_graph_host_us",
                                                                                 "whole_logits_host_us"))]
                                    for r in full], "l" * 8)]
            e = info["extend_graphs"]
            lines += ["", f"extend graphs: sizes {e['sizes']}, max_seqs {e['max_seqs']}, capture {e['capture_s']:.1f} s, "
                      f"pool {e['pool_bytes'] / 2**30:.2f} GiB. Executor.forward of a new prompt, alternated:"]
            lines += ["", md_table(["T", "piecewise ms", "extend graph ms"],
                                   [[r["T"], f"{r['forward_piecewise_ms']:.3f}", f"{r['forward_extend_graph_ms']:.3f}"]
                                    for r in full if "forward_piecewise_ms" in r], "lll")]
    if ext:
        lines += ["", *targets(ext)]
    if dec:
        lines += ["", f"decode over {info['context']}-token sequences", "",
                  md_table(["decode batch", "full graph ms (Executor.forward)", "graph replay alone ms", "eager ms"],
                           [[r["batch"], f"{r['graph_ms']:.3f}", f"{r.get('replay_ms', float('nan')):.3f}",
                             f"{r['eager_ms']:.3f}"] for r in dec], "llll")]
    return "\n".join(lines) + "\n"
