"""`pieceworks bench` against `pieceworks serve`, per quantization format and concurrency, one call.

For each format it starts `pieceworks serve CONFIG quantization.format=FMT` on 127.0.0.1, waits for
/health, runs `pieceworks bench --url ...` at each concurrency (prompts of --input-len random tokens
and --output-len new ones, both uniform in mean * [1 - R, 1 + R], ignore_eos), stops the server, and
ends with one markdown table of every run. Per run: DIR/FMT_cC.json; per server: DIR/serve_FMT.log.

    # H200, Llama-3.1-8B shape (random weights), NVFP4 and bf16, concurrency 1 / 16 / 64 (~5 min)
    python benchmarks/serve_bench.py --out DIR
    # CPU smoke run (tiny preset)
    python benchmarks/serve_bench.py --config '' --set model.arch=llama --set model.preset=tiny \\
        --formats none --concurrency 1,4 --input-len 16 --output-len 8 --out /tmp/sb
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ("format", "concurrency", "requests", "req/s", "output tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
           "TPOT p99", "ITL p50", "ITL p99")


def wait_up(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return True
        except OSError:
            time.sleep(0.5)
    return False


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def row(fmt: str, c: int, res: dict) -> list[str]:
    ms = lambda key, p: "-" if res[key][p] is None else f"{res[key][p]:.2f}"  # noqa: E731  (null: no request ok)
    return [fmt, str(c), f"{res['completed']}/{res['completed'] + res['failed']}", f"{res['request_throughput']:.2f}",
            f"{res['output_throughput']:.0f}", ms("ttft_ms", "p50"), ms("ttft_ms", "p99"), ms("tpot_ms", "p50"),
            ms("tpot_ms", "p99"), ms("itl_ms", "p50"), ms("itl_ms", "p99")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/llama-3.1-8b-random-fp4.yaml", help="YAML ('' for none)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeat)")
    ap.add_argument("--formats", default="nvfp4,none", help="quantization.format values (none: bf16)")
    ap.add_argument("--concurrency", default="1,16,64", help="comma-separated --max-concurrency values")
    ap.add_argument("--prompts-per-client", type=int, default=4, help="requests = max(16, this x concurrency)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to come up")
    ap.add_argument("--out", type=Path, required=True, help="directory for the JSON results and server logs")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    cli = [sys.executable, "-m", "pieceworks.cli"]
    rows = []
    for fmt in args.formats.split(","):
        serve = [*cli, "serve", *([args.config] if args.config else []), *args.set, f"quantization.format={fmt}",
                 "--served-model-name", f"model-{fmt}", "--port", str(args.port), "--max-queue", "4096"]
        log = open(args.out / f"serve_{fmt}.log", "w")
        t0 = time.monotonic()
        proc = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        if not wait_up(url, proc, args.startup_timeout):
            stop(proc) if proc.poll() is None else None
            print(f"server ({fmt}) did not come up:\n{(args.out / f'serve_{fmt}.log').read_text()[-3000:]}")
            continue
        print(f"== {fmt}: server up after {time.monotonic() - t0:.0f} s", flush=True)
        try:
            for c in (int(x) for x in args.concurrency.split(",")):
                result = args.out / f"{fmt}_c{c}.json"
                bench = [*cli, "bench", "--url", url, "--num-prompts", str(max(16, args.prompts_per_client * c)),
                         "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--range-ratio",
                         str(args.range_ratio), "--max-concurrency", str(c), "--seed", "0", "--no-progress",
                         "--result-json", str(result)]
                subprocess.run(bench, cwd=REPO, timeout=300)
                if result.exists():
                    rows.append(row(fmt, c, json.loads(result.read_text())))
        finally:
            stop(proc)
            log.close()
    print("\n| " + " | ".join(COLUMNS) + " |\n|" + " --- |" * len(COLUMNS))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"\n(ms; prompts {args.input_len} +- {args.range_ratio:.0%}, outputs {args.output_len} +- "
          f"{args.range_ratio:.0%}, streamed HTTP on 127.0.0.1; results in {args.out})")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
