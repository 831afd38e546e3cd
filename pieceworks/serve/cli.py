"""The arguments and entry points of `pieceworks serve` and `pieceworks bench` (registered by
`pieceworks.cli`, which turns the CONFIG and key=value arguments into a `Config`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import socket
import threading
from pathlib import Path
from typing import Any

from pieceworks import environment
from pieceworks.serve import REASONING_PARSERS, TOOL_CALL_PARSERS

log = logging.getLogger("pieceworks.serve")


def _port(text: str) -> int:
    """argparse type of --port: checked before the model loads, so a typo costs no load time."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number; use an integer in 0..65535") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is out of range; use a TCP port in 0..65535")
    return port


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port, 0..65535 (default 8000)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients pass (default: the model's path, or ARCH-PRESET such as llama-tiny "
                        "for random weights)")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="completions waiting for their first token before new requests get 503 (default 256)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="S",
                   help="on SIGTERM or Ctrl-C, seconds the requests in flight get to finish before they end with "
                        "finish_reason abort (default 5); a second signal aborts them at once")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on the /v1 routes (401 without it); default: "
                        "$PIECEWORKS_API_KEY, which keeps the key out of the process list, else none")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="read tool calls from the model's text under tool_choice auto: hermes (<tool_call> JSON "
                        "blocks: Hermes, Qwen), llama3_json (Llama 3.1 / 3.2's JSON calls), mistral, deepseek_v3 "
                        "(DeepSeek-V3 / R1), deepseek_v31 (DeepSeek-V3.1), glm45 (GLM-4.5 / 4.6 / 4.7), qwen3_coder "
                        "(Qwen3-Coder) or seed_oss (Seed-OSS); without it, "
                        "requests with tools take tool_choice required, a named function or none")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split chat answers of thinking models into reasoning_content (the <think> part) and "
                        "content: deepseek_r1 (DeepSeek-R1 and its distillations), qwen3, glm45 (GLM-4.5 / 4.6 / "
                        "4.7) or seed_oss (Seed-OSS)")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="a running server (http://HOST:PORT); without it the engine "
                                               "runs in this process from CONFIG")
    p.add_argument("--model", default=None, help="model name on the server (default: the first it lists)")
    p.add_argument("--num-prompts", type=int, default=64, metavar="N", help="requests to send (default 64)")
    p.add_argument("--input-len", type=int, default=256, metavar="T", help="mean random prompt length (tokens)")
    p.add_argument("--output-len", type=int, default=128, metavar="T", help="mean output length (tokens)")
    p.add_argument("--range-ratio", type=float, default=0.0, metavar="R",
                   help="lengths uniform in mean * [1 - R, 1 + R] (default 0: fixed)")
    p.add_argument("--dataset", type=Path, default=None, metavar="FILE",
                   help="prompts from the lines of a UTF-8 text file instead of random token ids (needs the "
                        "model's tokenizer)")
    p.add_argument("--request-rate", type=float, default=math.inf, metavar="RPS",
                   help="Poisson arrivals at this many requests/s (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, metavar="C", help="at most C requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request may take, from its start to its last token (default 600); one past it fails")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="with --url: sent as `Authorization: Bearer KEY` (a server started with --api-key); "
                        "default: $PIECEWORKS_API_KEY with --url, else none")
    p.add_argument("--result-json", type=Path, default=None, metavar="PATH", help="write the result here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def api_key(flag: str | None) -> str | None:
    """The API key: --api-key's value, else $PIECEWORKS_API_KEY (`environment.api_key`), else None. ValueError,
    naming where the key came from, unless it is printable ASCII without spaces (an HTTP header value that every
    client sends as given)."""
    key, source = (flag, "--api-key") if flag is not None else (environment.api_key(), environment.API_KEY_VARIABLE)
    if key is not None and not (key and key.isascii() and key.isprintable() and " " not in key):
        raise ValueError(f"{source}: the API key must be a non-empty string of printable ASCII characters "
                         "without spaces")
    return key


def check_bench_arguments(args: argparse.Namespace) -> None:
    """The bench flags, checked before any config or model loads: ValueError (FileNotFoundError for a missing
    --dataset) naming the flag."""
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency {args.max_concurrency}: must be at least 1")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout {args.timeout}: must be a finite number of seconds > 0")
    if args.url is not None and args.config:
        raise ValueError(f"--url drives a running server: CONFIG arguments {args.config} belong to the server")
    if args.url is not None:
        _check_url(args.url)
    if args.api_key is not None and args.url is None:
        raise ValueError("--api-key is sent to the server --url names; the in-process engine takes none")
    if args.url is not None:
        api_key(args.api_key)
    from pieceworks.serve.bench import check_range_ratio, check_request_rate, check_result_path, dataset_lines

    check_range_ratio(args.range_ratio)
    check_request_rate(args.request_rate)
    if args.dataset is not None:
        dataset_lines(args.dataset)
    if args.result_json is not None:
        check_result_path(args.result_json)


def _check_bench_model(args: argparse.Namespace, cfg: Any) -> None:
    """--dataset's text prompts need the in-process model's tokenizer: random weights (model.arch) have none."""
    if args.dataset is not None and not cfg.model.path:
        raise ValueError(f"--dataset {args.dataset}: text prompts need a tokenizer, and model.arch={cfg.model.arch} "
                         "builds random weights without one; give a model.path with one, or leave out --dataset "
                         "for random token-id prompts (--input-len)")


def _check_url(url: str) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url must be an http:// or https:// URL such as http://127.0.0.1:8000, got {url!r}")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"--url {url!r}: the port is not an integer in 0..65535") from None


def _need_serve_extra(*modules: str) -> None:
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(f"{name} is missing: install the serve extra (pip install 'pieceworks[serve]')") from exc


def bind_address(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free port the OS picks) and listening, that uvicorn serves on, so the
    port the server logs is the one it serves. ValueError unless this process can bind there now (checked before
    the model loads: a typo in --host or a port another server holds would otherwise show after the load). It
    listens at once: two sockets bound with SO_REUSEADDR may share a port until one listens, so a second server
    started beside this one is refused here, not after its load. Connections made during the load wait in the
    backlog until uvicorn serves them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # uvicorn's choice of family
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"--host {host}: not an address of this machine or a name it resolves ({exc}); use "
                         "127.0.0.1, 0.0.0.0 (all interfaces) or one of its addresses") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind(addr)
        sock.listen(2048)  # uvicorn's backlog
    except OSError as exc:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: can't listen there ({exc.strerror or exc}); another "
                         "server may hold the port: choose another --port, or --host an address of this "
                         "machine") from None
    return sock


def run_serve(args: argparse.Namespace, cfg: Any) -> int:
    """Build the engine, then serve it until interrupted (the engine shuts down on the way out)."""
    _need_serve_extra("fastapi", "uvicorn")
    import uvicorn

    if args.max_queue < 1:
        raise ValueError(f"--max-queue {args.max_queue}: must be at least 1 (requests waiting for a first token)")
    if not 0 <= args.shutdown_timeout <= 86400:  # NaN fails too
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout}: must be a number of seconds in 0..86400")
    key = api_key(args.api_key)
    sock = bind_address(args.host, args.port)

    from pieceworks.engine import AsyncEngine
    from pieceworks.serve.app import build_app

    with sock, AsyncEngine.from_config(cfg) as engine:
        app = build_app(engine, args.served_model_name, args.max_queue, args.tool_call_parser,
                        args.reasoning_parser, key)
        name = app.state.server.name
        port = sock.getsockname()[1]
        host = f"[{args.host}]" if ":" in args.host else args.host
        keyed = "" if key is None else (", an API key required: --api-key" if args.api_key is not None
                                        else f", an API key required: ${environment.API_KEY_VARIABLE}")
        log.info("serving %s at http://%s:%d (OpenAI API under /v1%s)", name, host, port, keyed)
        sched = engine.engine.scheduler.cfg
        log.info("steps of up to %d new tokens and %d sequences (scheduler.max_num_batched_tokens, max_num_seqs)",
                 sched.max_num_batched_tokens, sched.max_num_seqs)
        kv = engine.engine.executor.kv
        log.info("KV cache: %d tokens of %s (kv_cache.num_tokens / memory_fraction, kv_cache.dtype)", kv.num_tokens,
                 str(kv.dtype).removeprefix("torch."))
        spec = engine.engine.executor.cfg.speculative
        if spec.method is not None:
            while_ = "always" if spec.max_batch is None else f"while at most {spec.max_batch} requests run"
            log.info("speculative decoding: %s, up to %d drafts per row (n-grams of %d-%d tokens), %s; steps "
                     "that may draft run synchronously", spec.method, spec.num_speculative_tokens,
                     spec.prompt_lookup_min, spec.prompt_lookup_max, while_)
        # uvicorn cuts connections still open this long after the signal: the aborted streams have a second to end
        config = uvicorn.Config(app, host=args.host, port=port, log_level="warning",
                                timeout_graceful_shutdown=args.shutdown_timeout + 1)
        server = _draining_server(config, app.state.server, args.shutdown_timeout)

        def stop_on_failure() -> None:  # a failed step loop cannot serve again: stop, so a supervisor restarts us
            exc = engine.wait_failed()
            log.error("the engine's step loop failed (%r): stopping the server", exc)
            server.should_exit = True

        threading.Thread(target=stop_on_failure, name="pieceworks-serve-watch", daemon=True).start()
        server.run(sockets=[sock])
        failed = engine.wait_failed(0)
    if failed is not None:
        log.error("stopped: the engine failed")
        return 1
    log.info("stopped: the engine is shut down")
    return 0


def _draining_server(config: Any, state: Any, grace: float) -> Any:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, whose shutdown (SIGTERM, Ctrl-C) gives the requests in flight `grace` seconds and then
        aborts those left in the engine, so that their streams end with a finish_reason "abort" chunk and [DONE]
        (a response uvicorn cancels at its own deadline is cut mid-stream). A second signal aborts them at once
        (uvicorn's own would cut them mid-stream, with a traceback per connection); a third stops without waiting
        for them (uvicorn's forced exit, which uvicorn itself takes on a repeated SIGINT only)."""

        def __init__(self, config: Any, state: Any, grace: float):
            super().__init__(config)
            self.state, self.grace, self.signals = state, grace, 0

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.signals += 1
            loop = asyncio.get_event_loop()  # a signal handler runs in the loop's thread: hand over safely
            abort = lambda: asyncio.ensure_future(self.state.abort_all())  # noqa: E731
            n = len(self.state.in_flight)
            if self.signals == 1:
                log.info("shutting down: no new requests; %d in flight get %g s to finish, then end with "
                         "finish_reason abort (--shutdown-timeout)", n, self.grace)
                loop.call_soon_threadsafe(loop.call_later, self.grace, abort)
            elif self.signals == 2 and self.should_exit:
                log.info("second signal: %d in flight end now with finish_reason abort (a third stops at once)", n)
                loop.call_soon_threadsafe(abort)
                return
            super().handle_exit(sig, frame)
            if self.signals >= 3:  # uvicorn forces its exit on a repeated SIGINT only
                self.force_exit = True

    return DrainingServer(config, state, grace)


def run_bench(args: argparse.Namespace, cfg: Any) -> int:
    from pieceworks.serve.bench import run_bench as run

    if args.url is not None:
        _need_serve_extra("httpx")
    else:
        _check_bench_model(args, cfg)
    return run(args, cfg)
