"""`pieceworks chat` (pieceworks/chat.py): the conversation loop on the SmolLM2 demo model, its resets, the
messages it refuses and the answers Ctrl-C stops, and the command's refusal of a model without a template."""

from __future__ import annotations

import io


from pieceworks import SamplingParams
from pieceworks.chat import chat_loop

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def talk(engine, lines: list[str], params=GREEDY, system=None) -> tuple[list[str], str]:
    out, err = io.StringIO(), io.StringIO()
    assert chat_loop(engine, params, system, io.StringIO("".join(f"{x}\n" for x in lines)), out, err) == 0
    return out.getvalue().splitlines(), err.getvalue()


def answer(engine, messages: list[dict]) -> str:
    from pieceworks.models.tokenizer import render_chat

    return engine.generate(render_chat(engine.tokenizer, messages), GREEDY)[0].text


def test_turns_carry_the_conversation_and_reset_drops_it(smollm2_cpu_engine):
    engine = smollm2_cpu_engine
    q1, q2 = "What is the capital of France?", "And of Italy?"
    answers, err = talk(engine, [q1, "", q2, "/reset", q2, "/exit", "never read"])
    first = answer(engine, [{"role": "user", "content": q1}])
    second = answer(engine, [{"role": "user", "content": q1}, {"role": "assistant", "content": first},
                             {"role": "user", "content": q2}])
    alone = answer(engine, [{"role": "user", "content": q2}])
    assert answers == [first, second, alone] and second != alone
    assert err.count("tokens/s") == 3 and "starts over" in err
    with_system, _ = talk(engine, [q1], system="Answer in French.")
    assert with_system == [answer(engine, [{"role": "system", "content": "Answer in French."},
                                           {"role": "user", "content": q1}])]


def test_a_message_too_long_is_dropped_and_the_session_goes_on(smollm2_cpu_engine):
    engine = smollm2_cpu_engine
    long = "word " * engine.max_context
    answers, err = talk(engine, [long, "Hi"])
    assert "error:" in err and "dropped" in err
    assert answers == [answer(engine, [{"role": "user", "content": "Hi"}])]  # the long message left no trace


def test_ctrl_c_stops_one_answer(smollm2_cpu_engine, monkeypatch):
    engine = smollm2_cpu_engine
    real, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 4:  # a few tokens into the answer
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(engine, "step", step)
    answers, err = talk(engine, ["Tell me a story.", "Hi"])
    monkeypatch.undo()
    assert "(stopped)" in err and not engine.has_unfinished()
    assert len(answers) == 2 and answers[0]  # the partial answer, on a line of its own
    assert answers[1] == answer(engine, [{"role": "user", "content": "Hi"}])  # the stopped exchange was dropped


def test_a_model_without_a_chat_template_is_refused(capsys):
    from pieceworks.cli import main

    assert main(["chat", "model.arch=llama", "model.preset=tiny", "runtime.device=cpu"]) == 2
    assert "has no tokenizer with a chat template" in capsys.readouterr().err
    assert main(["chat", "--temperature", "-1"]) == 2  # checked before the model loads
    assert "temperature" in capsys.readouterr().err


def test_answers_sample_as_the_flags_else_the_configs_generation_else_chats_defaults(monkeypatch, capsys):
    import pieceworks.chat
    from pieceworks.cli import main

    seen = []
    monkeypatch.setattr(pieceworks.chat, "run_chat", lambda cfg, system, params: seen.append(params) or 0)
    tiny = ["chat", "model.arch=llama", "model.preset=tiny", "runtime.device=cpu"]
    assert main(tiny) == 0
    assert main([*tiny, "generation.temperature=0", "generation.max_new_tokens=3"]) == 0
    assert main([*tiny, "generation.temperature=0", "generation.max_new_tokens=3", "generation.top_p=0.5",
                 "--temperature", "0.25", "--max-tokens", "5"]) == 0
    assert [(p.max_tokens, p.temperature, p.top_p) for p in seen] == [(None, 0.7, 0.9), (3, 0.0, 0.9),
                                                                      (5, 0.25, 0.5)]
    for flag, value, says in (("--max-tokens", "-1", "--max-tokens -1: must be >= 1"),
                              ("--temperature", "nan", "--temperature nan: must be a finite number >= 0"),
                              ("--top-p", "0", "--top-p 0.0: must be in (0, 1]")):
        assert main([*tiny, flag, value]) == 2
        assert f"pieceworks chat: error: {says}" in capsys.readouterr().err
    assert len(seen) == 3
