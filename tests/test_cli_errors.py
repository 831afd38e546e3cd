"""The CLI boundary: every user error is one line on stderr with a non-zero exit and no traceback
(`--debug` shows it), and Ctrl-C at any moment, also while torch imports, exits 130 with "interrupted".

Where the process matters (stderr, exit codes, signals) the cases run the real `python -m pieceworks.cli`
in subprocesses, all started at once, each with a timeout so nothing hangs; errors found after torch
has loaded are also checked in process through `cli.main`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:  # `python -m pytest` puts the repository root on sys.path, plain `pytest` puts tests/
    from tests.helpers.smollm2_files import smollm2_dir
except ImportError:
    from helpers.smollm2_files import smollm2_dir

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240  # s; a case is a few seconds on an idle machine
LLAMA = ["model.arch=llama", "model.preset=tiny", "runtime.device=cpu", "kv_cache.num_tokens=256"]
BENCH = ["bench", *LLAMA, "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--no-progress"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pieceworks.cli", *args], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# name -> (arguments, exit code, the one stderr line must contain)
CASES = {
    "malformed yaml": (["run", "tab.yaml"], 2, "pieceworks run: error: tab.yaml:3: not valid YAML: found a tab"),
    "top-level list": (["backends", "list.yaml"], 2, "list.yaml: the top level is a list"),
    "yaml is a directory": (["run", "."], 2, "config file '.' is a directory; give a YAML file"),
    "unknown key": (["run", "model.arch=llama", "runtime.foo=1"], 2, "runtime.foo: unknown key"),
    "bad override syntax": (["run", "model.arch=llama", "nonsense"], 2, "argument 'nonsense': expected key=value"),
    "unknown command": (["frobnicate"], 2, "pieceworks: error: argument command: invalid choice: 'frobnicate'"),
    "unknown flag": (["run", "--nope"], 2, "pieceworks run: error: unrecognized arguments: --nope (settings go as "
                                           "key=value overrides, e.g. generation.max_new_tokens=64; see pieceworks "
                                           "run --help)"),
    "another tool's flag": (["chat", "--max-tokens", "5", "--device", "cpu"], 2,
                            "pieceworks chat: error: unrecognized arguments: --device (settings go as key=value "
                            "overrides (--device -> runtime.device=...); see pieceworks chat --help)"),
    "quantize takes no settings": (["quantize", "a", "b", "--zz"], 2,
                                   "pieceworks quantize: error: unrecognized arguments: --zz (see pieceworks "
                                   "quantize --help)"),
    "prompts without a tokenizer": (["run", *LLAMA, "generation.prompts=[hello]"], 2,
                                    "generation.prompts: given, but the model has no tokenizer"),
    "text is a directory": (["eval-ppl", *LLAMA, "--text", "."], 2, "--text .: is a directory"),
    "overrides on both sides of a flag": (["eval-ppl", LLAMA[0], "--text", ".", *LLAMA[1:]], 2,
                                          "--text .: is a directory"),
    "unparsable override value": (["run", "model.arch=llama", "model.arch=[llama"], 2,
                                  "pieceworks run: error: model.arch: can't parse the value '[llama' (did not "
                                  "find expected ',' or ']'); quote it or fix the brackets"),
    "seed out of range": (["run", *LLAMA, "runtime.seed=99999999999999999999999"], 2,
                          "pieceworks run: error: runtime.seed: 99999999999999999999999 is out of range"),
    "scalar for a list": (["run", *LLAMA, "generation.prompts=hello"], 2,
                          'pieceworks run: error: generation.prompts: expected a list (e.g. generation.prompts=["Hi",'
                          '"Hello"]), got \'hello\''),
    "empty key part": (["run", "model..arch=llama"], 2, "the key 'model..arch' is malformed (empty part between dots)"),
    "port above 65535": (["serve", *LLAMA, "--port", "99999"], 2,
                         "pieceworks serve: error: argument --port: 99999 is out of range; use a TCP port in 0..65535"),
    "negative port": (["serve", *LLAMA, "--port", "-1"], 2, "argument --port: -1 is out of range"),
    "shutdown timeout nan": (["serve", *LLAMA, "--shutdown-timeout", "nan"], 2,
                             "pieceworks serve: error: --shutdown-timeout nan: must be a number of seconds in 0..86400"),
    "bench url without a scheme": (["bench", "--url", "notaurl"], 2,
                                   "pieceworks bench: error: --url must be an http:// or https:// URL such as "
                                   "http://127.0.0.1:8000, got 'notaurl'"),
    "bench dataset without a tokenizer": ([*BENCH, "--dataset", "prompts.txt"], 2,
                                          "pieceworks bench: error: --dataset prompts.txt: text prompts need a "
                                          "tokenizer, and model.arch=llama builds random weights without one"),
    "bench dataset is a directory": (["bench", "--url", "http://127.0.0.1:1", "--dataset", "."], 2,
                                     "pieceworks bench: error: --dataset .: is a directory"),
    "bench result json is a directory": ([*BENCH, "--result-json", "."], 2,
                                         "pieceworks bench: error: --result-json .: is a directory"),
    "debug shows the traceback": (["run", "tab.yaml", "--debug"], 2, "Traceback (most recent call last)"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's (exit code, stdout, stderr), run concurrently."""
    cwd = tmp_path_factory.mktemp("cli")
    (cwd / "tab.yaml").write_text("model:\n  arch: llama\n\tpreset: tiny\n")
    (cwd / "list.yaml").write_text("- model\n- kv_cache\n")
    (cwd / "prompts.txt").write_text("a prompt\n")
    procs = {name: _start(args, cwd) for name, (args, _, _) in CASES.items()}
    out = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            out[name] = (p.returncode, stdout, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return out


@pytest.mark.parametrize("name", CASES)
def test_user_errors_are_one_line_on_stderr(results, name):
    _, code, needle = CASES[name]
    rc, stdout, stderr = results[name]
    assert rc == code, (rc, stderr[-2000:])
    assert needle in stderr, stderr[-2000:]
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    if name == "debug shows the traceback":  # the traceback, then the same line as without --debug
        assert lines[-1].startswith("pieceworks run: error: tab.yaml:3: not valid YAML"), lines[-3:]
    else:
        assert len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
        assert "error" not in stdout.lower(), stdout[-2000:]
    if CASES[name][0][0] == "bench":  # refused before the run: no table
        assert not stdout.strip(), stdout[-2000:]


BEYOND_MEMORY = ["model.sizes.vocab_size=2000000000", "model.sizes.hidden_size=200000"]

IN_PROCESS = {
    "model.sizes arithmetic": (["run", *LLAMA, "model.sizes.num_hidden_layers=0"], 2,
                               "pieceworks run: error: model.sizes.num_hidden_layers: 0 must be >= 1"),
    "backend typo": (["backends", "model.arch=llama", "backends.mla=nosuch"], 2,
                     "pieceworks backends: error: backends.mla: no mla backend named 'nosuch'"),
    "options of no backend": (["backends", "backends.options.nosuch.x=1"], 2,
                              "backends.options.nosuch: no registered backend is named 'nosuch'"),
    "config.json missing": (["run", "model.path=.", "runtime.device=cpu"], 2, "config.json: missing"),
    "eval-ppl of random weights": (["eval-ppl", *LLAMA, "--text", str(ROOT / "pieceworks/data/english.txt")], 2,
                                   "pieceworks eval-ppl: error: eval-ppl scores a text, which needs the model's "
                                   "tokenizer: model.arch builds random weights without one; give model.path"),
    "window of one token": (["eval-ppl", *LLAMA, "--text", str(ROOT / "pieceworks/data/english.txt"),
                             "--window", "1"], 2, "--window 1: a window needs at least 2 tokens"),
    "api key without a server": (["bench", "--api-key", "k", *LLAMA], 2,
                                 "pieceworks bench: error: --api-key is sent to the server --url names; the "
                                 "in-process engine takes none"),
    "an empty api key": (["serve", *LLAMA, "--api-key", ""], 2,
                         "pieceworks serve: error: --api-key: the API key must be a non-empty string of printable "
                         "ASCII"),
    "KV pool beyond memory": (["run", *LLAMA, "kv_cache.num_tokens=1000000000"], 2,
                              "kv_cache.num_tokens: 1000000000 tokens take 476.84 GiB at 512 bytes each, but"),
    "a size past any model": (["run", *LLAMA, "kv_cache.num_tokens=1000000000000"], 2,
                              "kv_cache.num_tokens: 1000000000000 must be at most 2147483647"),
    # 1.6e15 bytes of embedding (float32) and as many of head: refused from the meta skeleton, before any allocation
    "a model beyond memory": (["run", *LLAMA, *BEYOND_MEMORY], 2, "pieceworks run: error: the model's weights take "
                              "2980233.10 GiB on cpu (sizes from model.sizes), but "),
}


@pytest.mark.parametrize("name", IN_PROCESS)
def test_user_errors_in_process(name, capsys, monkeypatch, tmp_path):
    from pieceworks import cli

    monkeypatch.chdir(tmp_path)
    args, code, needle = IN_PROCESS[name]
    assert cli.main(args) == code
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], err[-2000:]
    if args[0] == "backends":  # refused before any of the report is printed
        assert not out.strip(), out[-2000:]


def test_an_allocation_past_memory_is_one_line(capsys, monkeypatch, tmp_path):
    """Where the free memory is unknown (no check before the load), the allocator's refusal is the one line: 1.6e15
    bytes are more than a 48-bit address space holds, refused under any overcommit setting."""
    from pieceworks import cli
    from pieceworks.models import sizing

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sizing, "free_bytes", lambda device, unknown: unknown)
    assert cli.main(["run", *LLAMA, *BEYOND_MEMORY]) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "pieceworks run: error: out of memory ([enforce fail" in lines[0], lines


def test_eval_ppl_refuses_a_text_it_cannot_score(capsys, tmp_path):
    from pieceworks import cli

    smol = [f"model.path={smollm2_dir()}", "runtime.device=cpu", "kv_cache.num_tokens=256"]
    english = str(ROOT / "pieceworks/data/english.txt")
    (tmp_path / "blank.txt").write_text(" \n")
    (tmp_path / "hi.txt").write_text("hi")
    for args, says in [
        (["--text", str(tmp_path / "blank.txt")],
         f"--text {tmp_path / 'blank.txt'}: empty (or only whitespace); give a text to score"),
        (["--text", str(tmp_path / "hi.txt")], f"--text {tmp_path / 'hi.txt'}: 1 token(s); perplexity needs at "
                                               "least 2 (one of context, one scored): give a longer text"),
        (["--text", english, "--window", "100000"],
         "--window 100000 exceeds the model's context of 256 tokens; use --window 256 or less"),
    ]:
        assert cli.main(["eval-ppl", *smol, *args]) == 2
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0] == f"pieceworks eval-ppl: error: {says}", lines


def test_serve_checks_where_it_listens_before_the_model_loads(capsys, monkeypatch):
    import socket

    pytest.importorskip("uvicorn")
    from pieceworks import cli
    from pieceworks.executor import build

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the listening address was checked")

    monkeypatch.setattr(build, "build_executor", no_load)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert cli.main(["serve", *LLAMA, "--port", str(port)]) == 2
    assert f"--host 127.0.0.1 --port {port}: can't listen there (Address already in use)" in capsys.readouterr().err
    from pieceworks.serve.cli import bind_address

    with bind_address("127.0.0.1", 0) as first:  # a second server started at the same moment: refused at once
        with pytest.raises(ValueError, match="can't listen there"):
            bind_address("127.0.0.1", first.getsockname()[1]).close()

    def unresolved(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    assert cli.main(["serve", *LLAMA, "--max-queue", "0"]) == 2
    assert "--max-queue 0: must be at least 1" in capsys.readouterr().err
    monkeypatch.setenv("PIECEWORKS_API_KEY", "two words")  # --api-key's default, checked as it is
    assert cli.main(["serve", *LLAMA]) == 2
    assert ("pieceworks serve: error: PIECEWORKS_API_KEY: the API key must be a non-empty string of printable ASCII "
            "characters without spaces") in capsys.readouterr().err
    from pieceworks.serve.cli import api_key

    assert api_key("k") == "k"  # the flag wins
    monkeypatch.setenv("PIECEWORKS_API_KEY", "")  # set but empty: unset
    assert api_key(None) is None
    monkeypatch.delenv("PIECEWORKS_API_KEY")
    monkeypatch.setattr(socket, "getaddrinfo", unresolved)
    assert cli.main(["serve", *LLAMA, "--host", "999.1.1.1"]) == 2
    assert "--host 999.1.1.1: not an address of this machine or a name it resolves" in capsys.readouterr().err


def test_bench_without_a_server(capsys):
    """Nothing listens at the URL: one line that names it, exit 2, before any request is sent."""
    pytest.importorskip("httpx", reason="needs the serve extra: pip install 'pieceworks[serve]'")
    from pieceworks import cli

    assert cli.main(["bench", "--url", "http://127.0.0.1:1", "--num-prompts", "1", "--no-progress"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("pieceworks bench: error: can't reach the server at http://127.0.0.1:1: ")
    assert lines[0].endswith("; is `pieceworks serve` running?"), lines[0]


BENCH_FLAGS = {  # flags -> the error line's text after "pieceworks bench: error: "
    ("--dataset", "prompts.txt"): "--dataset prompts.txt: text prompts need a tokenizer, and model.arch=llama "
                                  "builds random weights without one",
    ("--dataset", "latin1.txt"): "--dataset latin1.txt: not UTF-8 text (byte 3: invalid continuation byte)",
    ("--dataset", "none.txt"): "--dataset none.txt: no such file",
    ("--request-rate", "nan"): "--request-rate nan: must be a positive number of requests/s (inf: all at once)",
    ("--range-ratio", "1.5", "--dataset", "prompts.txt"): "--range-ratio 1.5: must be in [0, 1)",
    ("--result-json", "."): "--result-json .: is a directory; give a file path such as bench.json",
    ("--result-json", "nodir/out.json"): "--result-json nodir/out.json: nodir does not exist",
    ("--timeout", "0"): "--timeout 0.0: must be a finite number of seconds > 0",
}


@pytest.mark.parametrize("url", [False, True], ids=["in-process", "url"])
def test_bench_checks_its_flags_before_the_model_loads(url, capsys, monkeypatch, tmp_path):
    """In process, before the model loads; with --url, before the server is asked (nothing listens there)."""
    from pieceworks import cli
    from pieceworks.engine import AsyncEngine

    def loads(*args, **kwargs):
        raise AssertionError("the model loads before the bench flags are checked")

    monkeypatch.setattr(AsyncEngine, "from_config", loads)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("a prompt\n")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
    target = ["bench", "--url", "http://127.0.0.1:1", "--no-progress"] if url else BENCH
    for flags, needle in BENCH_FLAGS.items():
        if url and "model.arch" in needle:  # the server's tokenizer: tests/test_serve.py
            continue
        assert cli.main([*target, *flags]) == 2, flags
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"pieceworks bench: error: {needle}"), (flags, err)
        assert not out.strip(), out
    if url:  # the key bench sends where --api-key is not given: checked before the server is asked
        monkeypatch.setenv("PIECEWORKS_API_KEY", "two\nlines")
        assert cli.main(target) == 2
        assert capsys.readouterr().err.strip() == ("pieceworks bench: error: PIECEWORKS_API_KEY: the API key must be "
                                                   "a non-empty string of printable ASCII characters without spaces")


def _torch_mapped(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see when torch starts loading")
def test_ctrl_c_while_torch_imports_exits_130(tmp_path):
    p = _start(["run", *LLAMA], tmp_path)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not _torch_mapped(p.pid) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert p.poll() is None, "the process ended before torch loaded"
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, (p.returncode, stderr[-2000:])
    assert stderr.strip().splitlines()[-1] == "interrupted" and "Traceback" not in stderr, stderr[-2000:]


def test_ctrl_c_later_and_a_swallowed_interrupt_exit_130(monkeypatch, capsys):
    """In process: an interrupt inside a command, and one that a library's bare `except:` swallows."""
    from pieceworks import cli

    def interrupted(args):
        raise KeyboardInterrupt

    def swallowed(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here
        except BaseException:  # noqa: BLE001  (what a careless library does)
            pass
        return 0

    for command in (interrupted, swallowed):
        monkeypatch.setattr(cli, "cmd_backends", command)
        assert cli.main(["backends"]) == 130
        assert capsys.readouterr().err.strip() == "interrupted"


# name -> (a chat template that parses but fails while rendering, its line and Jinja's message)
BAD_TEMPLATES = {
    "raise_exception": ("{% if messages[0]['role'] == 'user' %}\n{{ raise_exception('Only system roles are "
                        "supported!') }}{% endif %}", "line 2: TemplateError: Only system roles are supported!"),
    "undefined attribute": ("{{ messages[0].content.foo.bar }}",
                            "line 1: UndefinedError: 'str object' has no attribute 'foo'"),
}


@pytest.fixture(scope="module")
def bad_template_runs(tmp_path_factory):
    """`pieceworks run` of the SmolLM2 demo checkpoint (weights linked, tokenizer files copied) with each
    of BAD_TEMPLATES as its chat_template.jinja: (model dir, exit code, stdout, stderr), run concurrently."""
    src = smollm2_dir()
    procs = {}
    for i, (name, (template, _)) in enumerate(BAD_TEMPLATES.items()):
        d = tmp_path_factory.mktemp(f"template{i}")
        for f in src.iterdir():
            if f.suffix == ".safetensors":
                (d / f.name).symlink_to(f)
            elif f.suffix in (".json", ".jinja"):
                (d / f.name).write_bytes(f.read_bytes())
        (d / "chat_template.jinja").write_text(template)
        procs[name] = (d, _start(["run", f"model.path={d}", "runtime.device=cpu", "kv_cache.num_tokens=256",
                                  "generation.max_new_tokens=2"], d))
    out = {}
    try:
        for name, (d, p) in procs.items():
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            out[name] = (d, p.returncode, stdout, stderr)
    finally:
        for _, p in procs.values():
            if p.poll() is None:
                p.kill()
    return out


@pytest.mark.parametrize("name", BAD_TEMPLATES)
def test_chat_template_that_fails_while_rendering(bad_template_runs, name):
    """A template that parses (so the tokenizer loads) but fails on the prompt (`raise_exception(...)`,
    an undefined attribute) is one line naming the file, Jinja's message and what to do; exit 2."""
    d, rc, stdout, stderr = bad_template_runs[name]
    assert rc == 2, (rc, stderr[-2000:])
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert lines[0] == (f"pieceworks run: error: {d / 'chat_template.jinja'}: the model's chat template failed while "
                        f"rendering ({BAD_TEMPLATES[name][1]}); run with generation.chat_template=false to encode "
                        "the prompts without it, or fix the template in chat_template.jinja"), lines[0]
    assert "error" not in stdout.lower(), stdout[-2000:]


def test_version_flag(capsys):
    from pieceworks import cli
    from pieceworks.version import __version__

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"pieceworks {__version__}"
    assert signal.getsignal(signal.SIGTERM) is before  # main()'s SIGTERM handler is its own while it runs
