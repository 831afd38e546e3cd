"""A reader that stops reading while its request runs on: the AsyncEngine merges the outputs it has not taken
(MERGE_AFTER per completion wait, not one per step, each carrying the whole output so far), and the server's pumps
stop at a bounded queue, so a stalled HTTP client holds O(output) memory, not O(output^2). A server stream closed
before it was read gives its places in the queue back. Tiny Llama on the CPU."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pieceworks import AsyncEngine, Engine, SamplingParams
from pieceworks.engine.async_engine import MERGE_AFTER, _Outputs
from pieceworks.engine.request import RequestOutput

PROMPT = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(3)).tolist()
PARAMS = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=4 * MERGE_AFTER)


def make() -> Engine:
    return Engine.from_config({"model": {"arch": "llama", "preset": "tiny"}, "runtime": {"device": "cpu"},
                               "kv_cache": {"num_tokens": 512, "page_size": 4}}, progress=False)


async def until_done(aeng: AsyncEngine) -> None:
    while aeng.engine.has_unfinished():
        await asyncio.sleep(0.01)


def test_outputs_a_reader_has_not_taken_merge_per_completion(monkeypatch):
    def out(index: int, new: list[int], so_far: list[int], delta: str, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", index, [1], new, so_far, "".join(map(str, so_far)), delta, finished,
                             "length" if finished else None, None, 0)

    monkeypatch.setattr("pieceworks.engine.async_engine.MERGE_AFTER", 2)
    q = _Outputs()
    q.put_nowait(out(0, [5], [5], "5"))
    q.put_nowait(out(1, [7], [7], "7"))
    q.put_nowait(out(0, [6], [5, 6], "6"))
    q.put_nowait(out(0, [3], [5, 6, 3], "3"))
    q.put_nowait(out(0, [8, 9], [5, 6, 3, 8, 9], "89", finished=True))
    error = RuntimeError("x")
    q.put_nowait(error)
    got = [asyncio.run(q.get()) for _ in range(4)]
    assert [(o.index, o.new_token_ids, o.token_ids, o.text_delta, o.text, o.finished) for o in got[:3]] == [
        (0, [5], [5], "5", "5", False), (1, [7], [7], "7", "7", False),
        (0, [6, 3, 8, 9], [5, 6, 3, 8, 9], "6389", "56389", True)]
    assert got[3] is error


def test_delta_outputs_a_reader_has_not_taken_merge_their_parts():
    """output_kind "delta": merged outputs join their token_ids, logprobs and text as their new tokens."""
    def out(new: list[int], finished: bool = False) -> RequestOutput:
        text = "".join(map(str, new))
        return RequestOutput("r", 0, [1], new, list(new), text, text, finished, "length" if finished else None,
                             [{t: -float(t)} for t in new], 0)

    q = _Outputs(delta=True)
    for k in range(MERGE_AFTER + 2):  # the last three merge into one
        q.put_nowait(out([k], finished=k == MERGE_AFTER + 1))
    got = [asyncio.run(q.get()) for _ in range(MERGE_AFTER)]
    last = got[-1]
    assert (last.new_token_ids, last.token_ids, last.text, last.text_delta, last.finished) == (
        [MERGE_AFTER - 1, MERGE_AFTER, MERGE_AFTER + 1], [MERGE_AFTER - 1, MERGE_AFTER, MERGE_AFTER + 1],
        f"{MERGE_AFTER - 1}{MERGE_AFTER}{MERGE_AFTER + 1}", f"{MERGE_AFTER - 1}{MERGE_AFTER}{MERGE_AFTER + 1}", True)
    assert last.logprobs == [{t: -float(t)} for t in last.token_ids]


def test_a_stalled_async_engine_reader_gets_one_merged_output_per_completion():
    async def main(aeng):
        outs = aeng.generate(PROMPT, PARAMS)
        first = [await outs.__anext__()]
        await until_done(aeng)
        return first, [o async for o in outs]

    with AsyncEngine(make()) as aeng:
        first, rest = asyncio.run(main(aeng))
    assert len(rest) <= 2 * (MERGE_AFTER + 1), len(rest)  # 4 * MERGE_AFTER steps ran
    finals = [o for o in rest if o.finished]
    assert sorted(o.index for o in finals) == [0, 1]
    for o in finals:
        streamed = [t for x in first + rest if x.index == o.index for t in x.new_token_ids]
        assert streamed == o.token_ids and len(o.token_ids) == PARAMS.max_tokens


def test_a_stalled_server_stream_holds_a_bounded_queue():
    from pieceworks.serve.server import Server

    async def main(srv):
        steps = srv.steps([PROMPT, PROMPT[:3]], [PARAMS, PARAMS], "slow")
        first = [await steps.__anext__()]
        await until_done(srv.engine)
        return first, [s async for s in steps]

    with AsyncEngine(make()) as aeng:
        first, rest = asyncio.run(main(Server(aeng)))
    # 4 completions: 2 x 2 queue slots, one held by each blocked pump, MERGE_AFTER + 1 per completion at most
    assert len(rest) <= 4 + 2 + 4 * (MERGE_AFTER + 1), len(rest)
    for c in {id(s.choice): s.choice for s in first + rest}.values():
        assert [t for s in first + rest if s.choice is c for t in s.new_token_ids] == c.token_ids
        assert len(c.token_ids) == PARAMS.max_tokens and c.finish_reason == "length"


def test_a_stream_closed_while_its_pumps_wait_on_the_full_queue_ends_and_aborts():
    from pieceworks.serve.server import Server

    async def main(srv):
        steps = srv.steps([PROMPT, PROMPT[:3]], [PARAMS, PARAMS], "gone")
        await steps.__anext__()
        await asyncio.sleep(0.3)  # the engine runs on; the pumps fill the queue and wait
        await asyncio.wait_for(steps.aclose(), 20)
        await until_done(srv.engine)

    with AsyncEngine(make()) as aeng:
        asyncio.run(main(Server(aeng)))
        assert aeng.engine.stats()["kv_pages_used"] == 0 and not aeng.engine.has_unfinished()


def test_a_server_stream_closed_before_its_first_step_gives_its_queue_places_back():
    """`Server.steps` takes the prompts' places (admit); a stream closed unread (a handler cancelled before its task
    ran: its generator never started) and a stream read to the end both leave the queue count where it was."""
    from pieceworks.serve.server import Overloaded, Server

    async def main(srv):
        short = SamplingParams(max_tokens=3)
        steps = srv.steps([PROMPT, PROMPT[:3]], [short, short], "unread")
        assert srv.num_queued == 2
        with pytest.raises(Overloaded):  # max_queue 3: two places taken
            srv.steps([PROMPT, PROMPT], [short, short], "over")
        await steps.aclose()
        assert srv.num_queued == 0 and not srv.engine.engine.has_unfinished()
        steps = srv.steps([PROMPT, PROMPT[:3]], [short, short], "read")
        assert len([s async for s in steps]) == 6 and srv.num_queued == 0
        steps = srv.steps([PROMPT, PROMPT[:3], PROMPT[:2]], [short] * 3, "full")  # all three places again
        await steps.__anext__()
        await steps.aclose()
        assert srv.num_queued == 0
        two = SamplingParams(max_tokens=3, n=2)  # a prompt's n completions take n places
        steps = srv.steps([PROMPT], [two], "n2")
        assert srv.num_queued == 2
        with pytest.raises(Overloaded):
            srv.steps([PROMPT, PROMPT], [short, short], "over")
        assert len([s async for s in steps]) == 6 and srv.num_queued == 0
        await until_done(srv.engine)

    with AsyncEngine(make()) as aeng:
        asyncio.run(main(Server(aeng, max_queue=3)))
        assert aeng.engine.stats()["kv_pages_used"] == 0


def test_a_stream_whose_event_loop_closed_is_aborted_and_its_id_freed():
    """A loop closed without shutdown_asyncgens (a torn-down worker thread's) never runs the stream's finally: the
    loop thread, unable to deliver, aborts the request (it ran on to max_tokens, holding its pages) and frees the id
    (refused as "already running" for good)."""
    import time

    async def start(aeng):
        outs = aeng.generate(PROMPT, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), "gone")
        await outs.__anext__()
        return outs

    async def again(aeng):
        return [o async for o in aeng.generate(PROMPT, SamplingParams(max_tokens=2), "gone")]

    with AsyncEngine(make()) as aeng:
        loop = asyncio.new_event_loop()
        outs = loop.run_until_complete(start(aeng))
        loop.close()
        deadline = time.monotonic() + 30
        while aeng.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = aeng.stats()
        assert stats["num_generated_tokens"] < 400 and stats["kv_pages_used"] == 0, stats
        assert "gone" not in aeng._streams and "gone" not in aeng._added
        assert asyncio.run(again(aeng))[-1].finished
        del outs


def test_streams_of_a_shut_down_engine_get_an_error_each():
    """One EngineDeadError per stream: a shared one gathered every stream's frames in its traceback."""
    async def main(aeng):
        streams = [aeng.generate(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True)) for _ in range(20)]
        for s in streams:
            await s.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, aeng.shutdown)
        errors = []
        for s in streams:
            try:
                async for _ in s:
                    pass
            except Exception as exc:
                errors.append(exc)
        return errors

    errors = asyncio.run(main(AsyncEngine(make())))  # streams that ended before the shutdown raise nothing
    assert len(errors) >= 2 and len({id(e) for e in errors}) == len(errors), len(errors)
    assert all(type(e).__name__ == "EngineDeadError" and "shut down" in str(e) for e in errors)


def test_shutdown_after_the_engine_was_closed_and_from_config_closes_its_own():
    """An embedder may close the Engine before the AsyncEngine; an AsyncEngine that built its Engine closes it."""
    engine = make()
    aeng = AsyncEngine(engine)
    engine.close()
    aeng.shutdown()
    with AsyncEngine(make()) as aeng:
        pass
    assert not aeng.engine.executor.closed  # the caller's Engine stays open
    aeng.engine.close()
    with AsyncEngine.from_config({"model": {"arch": "llama", "preset": "tiny"}, "runtime": {"device": "cpu"},
                                  "kv_cache": {"num_tokens": 512}}, progress=False) as aeng:
        pass
    assert aeng.engine.executor.closed
