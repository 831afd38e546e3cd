"""The tokenizer of a model directory (Hugging Face's, through transformers), checked when it loads:
files that are there but don't load, files the OS won't read and a chat template that is no Jinja are
errors that name the file, not tracebacks at the first prompt. A template that parses but fails while
rendering (`raise_exception(...)`, an undefined attribute) is a `RequestError` from `render_chat`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pieceworks.errors import CheckpointError, RequestError, TokenizerError
from pieceworks.util import unreadable

log = logging.getLogger(__name__)

# the files a Hugging Face tokenizer loads from; any of them present means the model has one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
# the files it reads beside them, any of which may be the one that does not load
SIDE_FILES = ("special_tokens_map.json", "added_tokens.json", "merges.txt", "chat_template.jinja", "chat_template.json")


def load_tokenizer(model_dir: Path | None, vocab_size: int | None = None):
    """The model directory's Hugging Face tokenizer; a warning where it holds more tokens than `vocab_size`, the
    model's (the ids past it would be refused in every prompt: a tokenizer of another model?).

    Raises:
        CheckpointError: the model has none (random weights, or no tokenizer files in its directory).
        TokenizerError: its tokenizer files are there but don't load, or the OS won't read one of them.
        ValueError: transformers is not installed.
    """
    if model_dir is None:
        raise CheckpointError("the model has no tokenizer (random weights: model.arch); pass token ids, "
                              "or load a model directory (model.path) that has one")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ValueError("tokenizing text needs transformers: pip install 'pieceworks[demo]'") from exc
    present = [n for n in TOKENIZER_FILES if (Path(model_dir) / n).exists()]
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # OSError, ValueError, and the tokenizers library's bare Exception
        if isinstance(exc, PermissionError):
            raise TokenizerError(str(unreadable(exc.filename or model_dir, exc))) from None
        if present:
            said = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
            said = said if len(said) <= 300 else said[:297] + "..."
            # a fast tokenizer's tokenizer_config.json without its tokenizer.json: that file is the one to fix
            lacking = "tokenizer.json is missing and " if present == ["tokenizer_config.json"] else ""
            files = present + [n for n in SIDE_FILES if (Path(model_dir) / n).exists()]
            raise TokenizerError(f"{model_dir}: {lacking}its tokenizer files ({', '.join(files)}) don't load "
                                 f"({type(exc).__name__}: {said}); fix or re-download them") from None
        raise CheckpointError(f"{model_dir}: the model has no tokenizer that transformers can load "
                              "(tokenizer.json / tokenizer_config.json); pass token ids, or add the "
                              "model's tokenizer files") from None
    _check_chat_template(tok, Path(model_dir))
    if vocab_size is not None and len(tok) > vocab_size:
        log.warning("%s: the tokenizer holds %d tokens, the model's vocabulary %d (config.json vocab_size): prompts "
                    "with ids from %d up are refused; is the tokenizer another model's?", model_dir, len(tok),
                    vocab_size, vocab_size)
    return tok


def _check_chat_template(tok: Any, model_dir: Path) -> None:
    """TokenizerError for a chat template that is no valid Jinja, or no text at all (transformers compiles
    it only when a chat is first rendered, where it would be a traceback or a refused request)."""
    templates = tok.chat_template if isinstance(tok.chat_template, dict) else {"": tok.chat_template}
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # another transformers: jinja2's parser with the loop controls transformers enables
        import jinja2.ext
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
        compile_template = env.parse
    import jinja2

    fix = "fix the template, or remove it to tokenize prompts without one"
    for name, template in templates.items():
        label = f" {name!r}" if name else ""
        if template is None:
            continue
        where = _template_source(model_dir, name)
        if not isinstance(template, str):
            raise TokenizerError(f"{where}: the chat template{label} is {template!r} "
                                 f"({type(template).__name__}), not Jinja text; {fix}")
        try:
            compile_template(template)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(f"{where}: the chat template{label} is not valid Jinja (line "
                                 f"{exc.lineno}: {exc.message}); {fix}") from None


def _template_source(model_dir: Path, name: str) -> Path:
    """The file a chat template (`name`: "" for the only one) comes from, as transformers reads them."""
    named = [f"additional_chat_templates/{name}.jinja"] if name else []
    for candidate in [*named, "chat_template.jinja"]:
        if (model_dir / candidate).is_file():
            return model_dir / candidate
    return model_dir / "tokenizer_config.json"


def render_chat(tok: Any, messages: list[dict], hint: str = "", *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
    """`messages` rendered by the tokenizer's chat template, as token ids: with the assistant turn opened
    (`add_generation_prompt`), or ending inside the last message (`continue_final_message`: the model goes
    on with it); `template_kwargs` are more variables for the template (e.g. a model's thinking switch).

    Raises:
        RequestError: the template fails while rendering these messages: it calls `raise_exception(...)`
            (many refuse roles they don't support), reads an undefined attribute, or raises inside
            its code. The message names the template's file and line, Jinja's message, and what to do
            (`hint` first, then: fix the template).
    """
    import traceback

    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message, tokenize=True,
                                      return_dict=False, **(template_kwargs or {}))
    except Exception as exc:
        import jinja2

        # the template's own frames (jinja rewrites them to "<template>", at the template's line)
        lines = [n for frame, n in traceback.walk_tb(exc.__traceback__) if frame.f_code.co_filename == "<template>"]
        if not lines and not isinstance(exc, jinja2.TemplateError):
            raise  # not the template's doing
        model_dir = Path(getattr(tok, "name_or_path", "") or ".")
        where = _template_source(model_dir, "default" if isinstance(tok.chat_template, dict) else "")
        at = f"line {lines[-1]}: " if lines else ""
        what = str(exc).strip() or "no message"
        fix = f"{hint + ', or ' if hint else ''}fix the template in {where.relative_to(model_dir)}"
        raise RequestError(f"{where}: the model's chat template failed while rendering ({at}{type(exc).__name__}: "
                           f"{what}); {fix}") from exc
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (each byte shown as a printable character) inverted: char -> byte."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(shown), 0
    for b in range(256):
        if b not in shown:
            shown.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(shown, chars)}


_BYTE_DECODER = _gpt2_byte_decoder()


SENTENCEPIECE_SPACE = "\u2581"  # a SentencePiece piece's leading space ("▁the")


def token_text(tok: Any, token_id: int) -> str:
    """One token's text as it reads inside a completion (logprobs' `token` strings): `decode([id])`, with the
    leading space a SentencePiece tokenizer (Llama 2, Mistral, Gemma) strips from a sequence's first piece put back
    (" the" for "▁the", not "the"), so the strings of a completion's tokens join to its text."""
    text = tok.decode([token_id])
    piece = tok.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and piece.startswith(SENTENCEPIECE_SPACE) and not text.startswith(" "):
        return " " + text
    return text


def token_bytes(tok: Any, token_id: int, text: str) -> bytes:
    """One token's own bytes, where `text` (its decoded text) is a replacement character standing for part
    of a UTF-8 sequence: a byte-fallback piece (`<0xE2>`, SentencePiece) or a byte-level BPE piece
    (GPT-2's alphabet: Llama 3, Qwen, SmolLM2) gives them; otherwise `text`'s UTF-8. Joined over a completion's
    tokens they rebuild characters that several tokens share (OpenAI's logprob `bytes`)."""
    if "\ufffd" not in text:
        return text.encode()
    piece = tok.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if piece and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
    return text.encode()
