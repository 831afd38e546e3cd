"""`pieceworks run | backends | quantize | eval-ppl | serve | bench`.

Every subcommand takes an optional YAML config and `key.sub=value` overrides. User mistakes (bad
config, a backend that can't serve, a bad checkpoint) print one clear message and exit 2; no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pieceworks.config import Config, ConfigError, load_config

DEFAULT_MODEL = "smollm2-135m-fp4"
DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a GPU is.",
]


def _split_config_args(items: list[str]) -> tuple[str | None, list[str]]:
    config, overrides = None, []
    for i, item in enumerate(items):
        if i == 0 and "=" not in item:
            config = item
        elif "=" in item:
            overrides.append(item)
        else:
            raise ConfigError(f"argument {item!r}: expected key=value (only the first argument may be a YAML file)")
    return config, overrides


def _config(args: argparse.Namespace, default_model: bool) -> Config:
    """The config from the command line; with `default_model`, the demo model when none is named."""
    config, overrides = _split_config_args(args.config)
    if default_model and not _has_model(config, overrides):
        overrides = [f"model.path={DEFAULT_MODEL}", *overrides]
    return load_config(config, overrides)


def _has_model(config: str | None, overrides: list[str]) -> bool:
    if any(o.startswith(("model.path=", "model.arch=")) for o in overrides):
        return True
    if config is None:
        return False
    from omegaconf import OmegaConf

    raw = OmegaConf.load(config) if Path(config).is_file() else {}
    model = raw.get("model", {}) if hasattr(raw, "get") else {}
    return bool(model and (model.get("path") or model.get("arch")))


def cmd_backends(args: argparse.Namespace) -> int:
    from pieceworks.report import print_backends

    config, overrides = _split_config_args(args.config)
    return print_backends(load_config(config, overrides, require_model=False))


def cmd_run(args: argparse.Namespace) -> int:
    from pieceworks.report import run_main_job

    return run_main_job(_config(args, default_model=True))


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from pieceworks.report import eval_perplexity

    return eval_perplexity(_config(args, default_model=True), Path(args.text), args.window)


def cmd_serve(args: argparse.Namespace) -> int:
    from pieceworks.serve.cli import run_serve

    return run_serve(args, _config(args, default_model=True))


def cmd_bench(args: argparse.Namespace) -> int:
    from pieceworks.serve.cli import check_bench_arguments, run_bench

    check_bench_arguments(args)
    return run_bench(args, None if args.url else _config(args, default_model=True))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pieceworks", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    cfg_help = "optional YAML config, then key.sub=value overrides"

    p = sub.add_parser("run", help="load a model, generate for sample prompts, print speed and backends")
    p.add_argument("config", nargs="*", help=cfg_help)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("backends", help="show every backend, whether it can serve here, and the kernel table")
    p.add_argument("config", nargs="*", help=cfg_help)
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("eval-ppl", help="perplexity of a model on a text file")
    p.add_argument("config", nargs="*", help=cfg_help)
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--window", type=int, default=512, help="tokens per scored window")
    p.set_defaults(func=cmd_eval_ppl)

    from pieceworks.serve.cli import add_bench_arguments, add_serve_arguments

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs pieceworks[serve])")
    p.add_argument("config", nargs="*", help=cfg_help)
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="serving benchmark: TTFT/TPOT/ITL and throughput, over HTTP or in-process")
    p.add_argument("config", nargs="*", help=cfg_help + " (in-process only)")
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)

    try:
        from pieceworks.quant.cli import register
    except ImportError:  # the quantizer ships with the NVFP4 tooling
        register = None
    if register is not None:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pieceworks.backends.registry import SelectionError
    from pieceworks.util import setup_logging

    args = build_parser().parse_args(argv)
    setup_logging(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return args.func(args) or 0
    except (ConfigError, SelectionError, ValueError, FileNotFoundError) as exc:
        if args.verbose:
            raise
        print(f"pieceworks {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
