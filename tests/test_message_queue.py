"""The shared-memory message queue alone (`parallel.message_queue`): a writer in this process, readers
in forked processes (they run only the queue's pure-Python code), a ring small enough that every test
wraps around it many times."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from multiprocessing import resource_tracker, shared_memory

import pytest

from pieceworks.parallel import message_queue
from pieceworks.parallel.message_queue import MessageQueue
from pieceworks.parallel.workers import WorkerDied

pytestmark = pytest.mark.skipif(not message_queue.usable(), reason="the queue needs x86-64 and /dev/shm")

CTX = multiprocessing.get_context("fork")


def segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("pieceworks-mq-")}


def read_all(name: str, reader: int, count: int, conn) -> None:
    """Reader process: attach, say so, read `count` objects and send them back."""
    q = MessageQueue.attach(name, reader)
    conn.send("attached")
    got = [q.get() for _ in range(count)]
    q.close()
    conn.send(got)


def read_on_request(name: str, reader: int, conn) -> None:
    """Reader process that reads one object per request on `conn` (a reader as slow as a test wants)."""
    q = MessageQueue.attach(name, reader)
    conn.send("attached")
    while conn.recv() == "read":
        conn.send(q.get())


def start(target, *args):
    parent, child = CTX.Pipe()
    p = CTX.Process(target=target, args=(*args, child), daemon=True)
    p.start()
    assert parent.poll(30) and parent.recv() == "attached"
    return p, parent


def messages() -> list:
    """Small, slot-sized, several-slot and longer-than-the-ring messages, and objects of other types."""
    out: list = []
    for i in range(120):
        size = [10, 200, 240, 241, 700, 3000][i % 6]
        out.append((i, os.urandom(size)))
    out += [None, {"pages": [list(range(64))] * 32}, "last"]
    return out


def test_every_reader_gets_every_message_in_order():
    sent = messages()
    q = MessageQueue.create(3, timeout_s=30, num_slots=4, slot_bytes=256)  # payload 240 B per slot
    readers = [start(read_all, q.name, r, len(sent)) for r in range(3)]
    for obj in sent:
        q.put(obj)
    for p, conn in readers:
        assert conn.poll(30)
        assert conn.recv() == sent
        p.join(10)
        assert p.exitcode == 0
    assert q.count > 4 * len(sent) // 3  # long messages spanned slots: the ring wrapped many times
    q.close()
    assert q.name not in segments()


def test_readers_close_without_removing_the_segment():
    q = MessageQueue.create(1, timeout_s=30)
    r = MessageQueue.attach(q.name, 0)
    q.put([1, 2, 3])
    assert r.get() == [1, 2, 3]
    r.close()
    assert q.name in segments()
    q.put("still works")  # the writer's mapping and name are untouched
    q.close()
    q.close()
    assert q.name not in segments()


def test_no_readers_never_blocks():
    """World size 1: no reader, every put still pickles and writes its slot."""
    q = MessageQueue.create(0, timeout_s=0.1, num_slots=2, slot_bytes=128)
    for i in range(20):
        q.put(list(range(i * 10)))
    assert q.count >= 20
    q.close()


def test_slow_reader_blocks_the_writer_until_the_timeout():
    q = MessageQueue.create(1, timeout_s=0.5, num_slots=2, slot_bytes=128)
    p, conn = start(read_on_request, q.name, 0)
    q.put("a")
    q.put("b")  # the ring is full now: the third put waits for the reader
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match=rf"reader 0 \(pid {p.pid}\) has not read message 1 within 0.5 s "
                                         r"\(parallel.timeout_s\): it is stuck or gone"):
        q.put("c")
    assert 0.5 <= time.monotonic() - t0 < 5
    conn.send("read")
    assert conn.recv() == "a"
    q.put("c")  # the slot is free again
    for want in ("b", "c"):
        conn.send("read")
        assert conn.recv() == want
    conn.send("stop")
    p.join(10)
    q.close()


def test_dead_reader_is_detected_before_the_timeout():
    q = MessageQueue.create(2, timeout_s=60, num_slots=2, slot_bytes=128)
    alive, conn = start(read_on_request, q.name, 0)
    dead, _ = start(read_on_request, q.name, 1)
    os.kill(dead.pid, signal.SIGKILL)
    dead.join(10)
    q.put("a")
    q.put("b")
    conn.send("read")
    assert conn.recv() == "a"
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match=rf"reader 1 \(pid {dead.pid}\) exited without reading message 1"):
        q.put("c")
    assert time.monotonic() - t0 < 5
    conn.send("stop")
    alive.join(10)
    q.close()
    assert q.name not in segments()


def write_then_wait(name_conn) -> None:
    """Writer process: create a queue for one reader, send its name, then wait to be killed."""
    q = MessageQueue.create(1, timeout_s=30)
    name_conn.send(q.name)
    q.put("hello")
    time.sleep(120)


def test_reader_notices_that_the_writer_is_gone():
    resource_tracker.ensure_running()  # the writer shares it, so the unlink below unregisters its segment
    parent, child = CTX.Pipe()
    writer = CTX.Process(target=write_then_wait, args=(child,), daemon=True)
    writer.start()
    assert parent.poll(30)
    name = parent.recv()
    r = MessageQueue.attach(name, 0)
    try:
        assert r.get() == "hello"
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"leader \(pid {writer.pid}\) exited; message 2 will not come"):
            r.get()
        assert time.monotonic() - t0 < 5
    finally:
        r.shm.unlink()  # the writer was killed before it could: its resource tracker would, at exit
        r.close()
    assert name not in segments()


def read_until_the_writer_is_gone(name: str, conn) -> None:
    q = MessageQueue.attach(name, 0)
    conn.send((name, q.get()))
    try:
        q.get()
    except RuntimeError as exc:
        conn.send(str(exc))
    q.close()


def write_for_a_child_reader(conn) -> None:
    """Writer process whose reader is its own child (as in-process workers are the leader's)."""
    q = MessageQueue.create(1, timeout_s=30)
    CTX.Process(target=read_until_the_writer_is_gone, args=(q.name, conn), daemon=True).start()
    q.put("hello")
    time.sleep(120)


def test_worker_notices_that_its_parent_writer_is_gone():
    resource_tracker.ensure_running()
    parent, child = CTX.Pipe()
    writer = CTX.Process(target=write_for_a_child_reader, args=(child,))
    writer.start()
    name = None
    try:
        assert parent.poll(30)
        name, first = parent.recv()
        assert first == "hello"
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)
        assert parent.poll(10), "the reader did not notice"
        assert parent.recv() == f"the tensor-parallel leader (pid {writer.pid}) exited; message 2 will not come"
    finally:
        writer.kill()
        if name in segments():  # the killed writer's tracker (this process's) would remove it at exit
            leftover = shared_memory.SharedMemory(name=name)
            leftover.close()
            leftover.unlink()


def test_attach_checks_its_reader_index():
    q = MessageQueue.create(2, timeout_s=1)
    with pytest.raises(ValueError, match="reader 2 of a queue with 2 readers"):
        MessageQueue.attach(q.name, 2)
    q.close()


FOLLOWER = """
import hashlib, pickle, sys
import torch
from pieceworks.parallel.group import init_groups
groups = init_groups(1, 2, torch.device("cpu"), sys.argv[1], 30.0)
print("QUEUE", groups.queue is not None, flush=True)
while (msg := groups.broadcast()) is not None:
    print("GOT", hashlib.sha1(pickle.dumps(msg)).hexdigest(), flush=True)
groups.close()
"""


@pytest.mark.parametrize("transport", ["queue", "gloo"])
def test_process_groups_broadcast(transport, tmp_path, monkeypatch):
    """`ProcessGroups.broadcast` between two processes through either transport (gloo: the leader's
    host facts say the queue can't run, as ranks on two hosts would), messages longer than a slot and
    than gloo's preallocated buffer included; nothing is left in /dev/shm."""
    import hashlib
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from pieceworks.parallel.group import init_groups

    if transport == "gloo":
        monkeypatch.setattr(message_queue, "usable", lambda: False)
    init_method = (tmp_path / "store").as_uri()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    follower = subprocess.Popen([sys.executable, "-c", FOLLOWER, init_method], stdout=subprocess.PIPE, text=True,
                                env=env)
    groups = init_groups(0, 2, torch.device("cpu"), init_method, 30.0)
    try:
        assert (groups.queue is not None) == (transport == "queue")
        name = groups.queue.name if groups.queue is not None else None
        sent = [("step", [[1]], [4], [[0, 1]], False), {"pages": list(range(40_000))}, os.urandom(100_000), "end"]
        for i, msg in enumerate(sent):
            groups.broadcast(msg, wait=i % 2 == 0)
        groups.broadcast(None)
        out, _ = follower.communicate(timeout=60)
    finally:
        groups.close()
        follower.kill()
    assert out.splitlines() == [f"QUEUE {transport == 'queue'}"] + [
        f"GOT {hashlib.sha1(pickle.dumps(m)).hexdigest()}" for m in sent]
    assert name not in segments()
