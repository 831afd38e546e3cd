"""The server against OpenAI's API as its clients use it: an assistant message sent back as the SDK returns it,
OpenAI's own request fields (accepted, or refused by name), messages without content, the developer role."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'pieceworks[serve]'")

from pieceworks.serve import mapping  # noqa: E402
from pieceworks.serve.protocol import BadRequest, ChatCompletionRequest, parse_body  # noqa: E402

USER = {"role": "user", "content": "What is the capital of France?"}


class _Template:
    """A tokenizer stand-in: renders its chat template with Jinja (with the variables apply_chat_template passes
    on) and encodes the text as bytes."""

    name_or_path = "/srv/models/m"

    def __init__(self, template: str):
        self.chat_template = template

    def apply_chat_template(self, messages, add_generation_prompt=True, continue_final_message=False, tokenize=True,
                            return_dict=False, **variables):
        import jinja2

        text = jinja2.Environment().from_string(self.chat_template).render(messages=messages, **variables)
        return list(text.encode())


ROLES = _Template("{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}{{ reasoning_effort }}")


def rendered(body: dict, tok=ROLES) -> str:
    req = parse_body(json.dumps({"model": "m", **body}).encode(), ChatCompletionRequest)
    mapping.refuse_unsupported(req)
    return bytes(mapping.chat_prompt(req, tok)).decode()


def refused(body: dict, param: str, match: str = "") -> BadRequest:
    with pytest.raises(BadRequest) as exc:
        rendered(body)
    assert exc.value.param == param and match in str(exc.value), (str(exc.value), exc.value.param)
    return exc.value


# ---- messages and OpenAI's request fields --------------------------------------------------------------


def test_assistant_messages_as_the_sdk_returns_them():
    """`messages.append(resp.choices[0].message.model_dump())`: OpenAI's fields on the message, null or ignored;
    a refusal with no content is that turn's text."""
    dumped = {"role": "assistant", "content": "Paris.", "refusal": None, "annotations": [], "audio": None,
              "function_call": None, "tool_calls": None}
    assert rendered({"messages": [USER, dumped]}) == f"user:{USER['content']}|assistant:Paris.|"
    refusal = {**dumped, "content": None, "refusal": "I can't help with that."}
    assert rendered({"messages": [USER, refusal]}).endswith("|assistant:I can't help with that.|")
    refused({"messages": [USER, {**dumped, "audio": {"id": "audio_1"}}]}, "messages.1.audio", "audio is not supported")
    refused({"messages": [USER, {**dumped, "function_call": {"name": "f", "arguments": "{}"}}]},
            "messages.1.function_call", "tool_calls")
    refused({"messages": [{**USER, "refusal": "no"}]}, "messages.0.refusal", "only assistant messages")
    with pytest.raises(BadRequest, match="messages.0.cache_control: Extra inputs"):  # not OpenAI's: refused
        rendered({"messages": [{**USER, "cache_control": {"type": "ephemeral"}}]})


def test_openai_request_fields_accepted_or_refused_by_name():
    msgs = [USER]
    assert rendered({"messages": msgs, "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
                     "modalities": ["text"], "prediction": None, "audio": None})
    refused({"messages": msgs, "store": True}, "store", "stores nothing")
    refused({"messages": msgs, "modalities": ["text", "audio"]}, "modalities", "text only")
    for name, value, why in (("functions", [{"name": "f"}], "use tools"), ("function_call", "auto", "use tool_choice"),
                             ("prediction", {"type": "content", "content": "x"}, "predicted outputs"),
                             ("web_search_options", {}, "search"), ("audio", {"voice": "alloy"}, "text only")):
        refused({"messages": msgs, name: value}, name, why)
    with pytest.raises(BadRequest, match="temprature"):  # a field OpenAI lacks is refused as before
        rendered({"messages": msgs, "temprature": 1})


def test_reasoning_effort_is_a_template_variable():
    assert rendered({"messages": [USER], "reasoning_effort": "low"}).endswith("|low")
    assert rendered({"messages": [USER], "chat_template_kwargs": {"reasoning_effort": "high"}}).endswith("|high")
    refused({"messages": [USER], "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
            "reasoning_effort", "disagree")


def test_messages_without_content():
    """OpenAI refuses a user, system, developer or tool message without content; an assistant message may leave
    it out when it carries tool_calls or a refusal."""
    for role in ("user", "system", "developer", "tool"):
        for message in ({"role": role}, {"role": role, "content": None}, {"role": role, "content": []}):
            refused({"messages": [message]}, "messages.0.content", f"a {role!r} message needs content")
    assert rendered({"messages": [{"role": "user", "content": ""}]}) == "user:|"  # empty text is content
    refused({"messages": [USER, {"role": "assistant", "content": None}]}, "messages.1.content",
            "content, tool_calls or a refusal")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert rendered({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [call]}]})


def test_the_developer_role_reaches_the_template_as_system():
    assert rendered({"messages": [{"role": "developer", "content": "Be brief."}, USER]}).startswith(
        "system:Be brief.|user:")

