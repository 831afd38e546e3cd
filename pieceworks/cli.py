"""`pieceworks run | chat | backends | quantize | eval-ppl | serve | bench`.

Every subcommand takes an optional YAML config and `key.sub=value` overrides. A user mistake (bad
config, checkpoint, request or argument, a backend that can't serve, a missing file, a server that
`bench --url` can't reach) prints one line on stderr, `pieceworks <command>: error: <what is wrong>`,
and exits 2; a failure of a well-formed run (out of KV pages, non-finite logits) exits 1 the same way;
`--debug` (anywhere on the line) shows the traceback before that line (the exit status stays). Ctrl-C at any
moment, also while torch imports, exits 130 with "interrupted".
"""

from __future__ import annotations

import signal
import sys
import threading

# Nothing heavy is imported above this line (`import pieceworks` loads only the errors): the SIGINT
# handler is in place before torch, omegaconf or any backend loads, so an early Ctrl-C is reported like
# a late one.
_interrupted = False


def _on_sigint(signum: int, frame: object) -> None:
    # Remembered as well as raised: a library's bare `except:` may swallow the KeyboardInterrupt (some
    # import-time probes do), and main() still exits 130 then.
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def _on_sigterm(signum: int, frame: object) -> None:
    # SystemExit unwinds like Ctrl-C does (the executor, its tensor-parallel workers and their rendezvous are
    # closed on the way out) where the default action would end the process on the spot; the status is the
    # signal's, 128 + 15, as a shell reports a process SIGTERM ended.
    raise SystemExit(128 + signal.SIGTERM)


if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, _on_sigint)

import argparse  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from pieceworks.errors import ConfigError  # noqa: E402
from pieceworks.version import __version__  # noqa: E402
from pieceworks.models.ppl import DEFAULT_WINDOW  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-fp4"
# flags of other tools that are config keys here (named in the hint of an "unrecognized arguments" error)
SETTING_FLAGS = {"--max-tokens": "generation.max_new_tokens", "--max-new-tokens": "generation.max_new_tokens",
                 "--temperature": "generation.temperature", "--top-p": "generation.top_p", "--model": "model.path",
                 "--device": "runtime.device", "--dtype": "runtime.dtype", "--seed": "runtime.seed",
                 "--tensor-parallel-size": "parallel.tensor_parallel_size", "--kv-cache-dtype": "kv_cache.dtype"}
CHAT_GENERATION = (None, 0.7, 0.9)  # chat's max_tokens (None: the rest of the context), temperature, top_p
USER_ERROR, RUN_ERROR, INTERRUPTED = 2, 1, 130


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


def _config(args: argparse.Namespace, default_model: bool) -> Any:
    """The config from the command line; with `default_model`, the demo model when none is named."""
    from pieceworks.config import load_config

    config, overrides = _split_config_args(args.config)
    cfg = load_config(config, overrides, require_model=not default_model)
    if default_model and cfg.model.path is None and cfg.model.arch is None:
        cfg = load_config(config, [f"model.path={DEFAULT_MODEL}", *overrides])
    return cfg


def cmd_chat(args: argparse.Namespace) -> int:
    global _interrupted
    from pieceworks.engine import SamplingParams

    # the flags' rules are generation.*'s (checked with the config), and their errors name the flag as typed
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: must be >= 1")
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature {args.temperature}: must be a finite number >= 0 (0: greedy)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p {args.top_p}: must be in (0, 1]")
    cfg = _config(args, default_model=True)
    configured = cfg.generation.settings(*CHAT_GENERATION)  # generation.* where set, else chat's defaults
    max_tokens, temperature, top_p = (flag if flag is not None else value for flag, value
                                      in zip((args.max_tokens, args.temperature, args.top_p), configured))
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
    from pieceworks.chat import run_chat  # torch: after the config is known to be good

    code = run_chat(cfg, args.system, params)
    _interrupted = False  # a Ctrl-C that stopped an answer stopped only that answer (chat_loop handled it)
    return code


def cmd_backends(args: argparse.Namespace) -> int:
    from pieceworks.config import load_config

    config, overrides = _split_config_args(args.config)
    cfg = load_config(config, overrides, require_model=False)
    from pieceworks.report import print_backends  # torch: after the config is known to be good

    return print_backends(cfg)


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _config(args, default_model=True)
    from pieceworks.report import run_main_job  # torch: after the config is known to be good

    return run_main_job(cfg)


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from pieceworks.util import flag_text

    text = Path(args.text)
    flag_text("--text", text)
    if args.window is not None and args.window < 2:
        raise ValueError(f"--window {args.window}: a window needs at least 2 tokens (one of context, one scored)")
    cfg = _config(args, default_model=True)
    from pieceworks.report import eval_perplexity  # torch: after the inputs are known to be good

    return eval_perplexity(cfg, text, args.window)


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors as one line (argparse prints the usage block first)."""

    takes_settings = False  # a command with the `config` positional: YAML, then key=value overrides
    missing_hint = ""  # said where required arguments are missing (quantize: after --exclude, SRC DST are patterns)

    def add_argument(self, *names: Any, **kwargs: Any) -> Any:
        self.takes_settings = self.takes_settings or names[:1] == ("config",)
        return super().add_argument(*names, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = f"see {self.prog} --help"
        if message.startswith("unrecognized arguments") and self.takes_settings:  # a setting typed as a flag
            said = message.split(":", 1)[1].split()
            known = [f"{flag} -> {key}=..." for flag, key in SETTING_FLAGS.items() if flag in said]
            hint = ("settings go as key=value overrides" + (f" ({', '.join(known)})" if known else
                                                           ", e.g. generation.max_new_tokens=64") + f"; {hint}")
        if message.startswith("the following arguments are required") and self.missing_hint:
            hint = f"{self.missing_hint}; {hint}"
        print(f"{self.prog}: error: {message} ({hint})", file=sys.stderr)
        sys.exit(USER_ERROR)


def cmd_serve(args: argparse.Namespace) -> int:
    from pieceworks.serve.cli import run_serve

    return run_serve(args, _config(args, default_model=True))


def cmd_bench(args: argparse.Namespace) -> int:
    from pieceworks.serve.cli import check_bench_arguments, run_bench

    check_bench_arguments(args)
    return run_bench(args, None if args.url else _config(args, default_model=True))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pieceworks", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"pieceworks {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (accepted anywhere on the line)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parser.set_defaults(commands=sub.choices)  # {name: its parser}: an unknown flag is named by its command
    cfg_help = "optional YAML config, then key.sub=value overrides"

    p = sub.add_parser("run", help="load a model, generate for sample prompts, print speed and backends")
    p.add_argument("config", nargs="*", help=cfg_help)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="a conversation with a model in the terminal (its chat template)")
    p.add_argument("config", nargs="*", help=cfg_help)
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="most tokens per answer (default: generation.max_new_tokens, else the rest of the context)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature, 0: greedy (default: generation.temperature, else 0.7)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: generation.top_p, else 0.9)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("backends", help="show every backend, whether it can serve here, and the kernel table")
    p.add_argument("config", nargs="*", help=cfg_help)
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("eval-ppl", help="perplexity of a model on a text file")
    p.add_argument("config", nargs="*", help=cfg_help)
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--window", type=int, default=None,
                   help=f"tokens per scored window, at most the model's context (default: {DEFAULT_WINDOW}, "
                        "or the context when shorter)")
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


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the input or the environment is wrong, not pieceworks: one line, exit 2."""
    return (ValueError, OSError)


def _run_errors() -> tuple[type[BaseException], ...]:
    """A well-formed run that can't finish (capacity, numerics, a missing optional package): exit 1."""
    from pieceworks.errors import NonFiniteLogits, OutOfPages

    errors: list[type[BaseException]] = [OutOfPages, NonFiniteLogits, ImportError, MemoryError]
    if "pieceworks.parallel.workers" in sys.modules:  # a tensor-parallel rank died or stopped answering
        errors.append(sys.modules["pieceworks.parallel.workers"].WorkerDied)
    if "torch" in sys.modules:
        errors.append(sys.modules["torch"].OutOfMemoryError)
    if "pieceworks.models.smollm2" in sys.modules:
        errors.append(sys.modules["pieceworks.models.smollm2"].SmolLM2NotInstalled)
    return tuple(errors)


def _host_out_of_memory(exc: BaseException) -> bool:
    """torch's CPU allocator refusing a tensor (a RuntimeError, not a MemoryError)."""
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def _one_line(exc: BaseException) -> str:
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if isinstance(exc, MemoryError) or _host_out_of_memory(exc):  # a size from config.json or the config
        return (f"out of memory ({text or type(exc).__name__}); check the model's sizes (its config.json, or "
                "model.sizes) and kv_cache.num_tokens")
    return text or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """The command line's entry point. SIGTERM unwinds it (`_on_sigterm`) while it runs; the handler before it is
    back afterwards, so a process that calls main() in-process (a test runner) keeps its own."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    try:
        return _main(argv)
    finally:
        if in_main and previous is not None:  # None: a handler not installed from Python, left as it was
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    global _interrupted
    _interrupted = False
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    command = "pieceworks"
    try:
        from pieceworks.util import setup_logging

        args, unknown = build_parser().parse_known_args(argv)
        if unknown and isinstance(getattr(args, "config", None), list) and not any(a.startswith("-") for a in unknown):
            args.config += unknown  # `CONFIG --flag X key=value`: the overrides after a flag, in their order
        elif unknown:
            args.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
        command = f"pieceworks {args.command}"
        setup_logging(logging.DEBUG if args.verbose else logging.INFO)
        code = args.func(args) or 0
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as exc:
        if isinstance(exc, _run_errors()) or _host_out_of_memory(exc):
            code = RUN_ERROR
        elif isinstance(exc, _user_errors()):
            code = USER_ERROR
        else:  # a bug in pieceworks or a plugin, not a user error: keep the traceback
            raise
        if debug:  # the traceback, and the same line and exit status as without --debug
            traceback.print_exc()
        print(f"{command}: error: {_one_line(exc)}", file=sys.stderr)
        return code
    if _interrupted:  # the KeyboardInterrupt was swallowed on the way (see _on_sigint)
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    return code


if __name__ == "__main__":
    sys.exit(main())
