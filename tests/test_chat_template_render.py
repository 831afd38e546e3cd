"""`render_chat`: a chat template that parses but fails while rendering is a `RequestError` (what the server
answers 400 and the CLI prints as one line) naming the template's file and line and Jinja's message; an
error that is not the template's passes through unchanged. The CLI side is in test_cli_errors.py."""

from __future__ import annotations

import json

import pytest

from pieceworks.errors import RequestError

try:  # `python -m pytest` puts the repository root on sys.path, plain `pytest` puts tests/
    from tests.helpers.smollm2_files import copy_tokenizer, smollm2_dir
except ImportError:
    from helpers.smollm2_files import copy_tokenizer, smollm2_dir

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The SmolLM2 demo model's tokenizer files (no weights)."""
    d = tmp_path_factory.mktemp("tok")
    copy_tokenizer(smollm2_dir(), d)
    return d


def _load(d, template):
    from pieceworks.models.tokenizer import load_tokenizer

    (d / "chat_template.jinja").write_text(template)
    return load_tokenizer(d)


def test_the_intact_template_renders(tokenizer_dir):
    from pieceworks.models.tokenizer import render_chat

    tok = _load(tokenizer_dir, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    assert render_chat(tok, USER) == tok.encode("user: hi\n")


@pytest.mark.parametrize("template, what", [
    ("{{ raise_exception('no users here') }}", "line 1: TemplateError: no users here"),
    ("\n\n{{ messages[0].content.foo.bar }}", "line 3: UndefinedError: 'str object' has no attribute 'foo'"),
    ("{{ messages[0].content + 1 }}", 'line 1: TypeError: can only concatenate str (not "int") to str'),
])
def test_a_template_that_fails_while_rendering(tokenizer_dir, template, what):
    from pieceworks.models.tokenizer import render_chat

    tok = _load(tokenizer_dir, template)
    with pytest.raises(RequestError) as e:
        render_chat(tok, USER)
    assert str(e.value) == (f"{tokenizer_dir / 'chat_template.jinja'}: the model's chat template failed while "
                            f"rendering ({what}); fix the template in chat_template.jinja")
    with pytest.raises(RequestError, match=r"; pass X, or fix the template in chat_template.jinja$"):
        render_chat(tok, USER, hint="pass X")


def test_the_file_of_a_template_from_tokenizer_config(tokenizer_dir, tmp_path):
    from pieceworks.models.tokenizer import load_tokenizer, render_chat

    for f in tokenizer_dir.iterdir():
        if f.name != "chat_template.jinja":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('no') }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(RequestError, match=r"tokenizer_config.json: the model's chat template failed while "
                                           r"rendering \(line 1: TemplateError: no\); fix the template in "
                                           r"tokenizer_config.json$"):
        render_chat(load_tokenizer(tmp_path), USER)


def test_an_error_that_is_not_the_templates_passes_through(tokenizer_dir, monkeypatch):
    from pieceworks.models.tokenizer import render_chat

    tok = _load(tokenizer_dir, "{{ messages[0].content }}")

    def broken(*args, **kwargs):
        raise ValueError("not a template's doing")

    monkeypatch.setattr(tok, "apply_chat_template", broken)
    with pytest.raises(ValueError, match="not a template's doing") as e:
        render_chat(tok, USER)
    assert not isinstance(e.value, RequestError)
