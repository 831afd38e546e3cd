"""A single-writer, multi-reader message ring in shared memory: the leader's step messages to the
followers that run on its host.

A gloo broadcast of a small message costs the leader tens of microseconds of host time per step
(Python wrappers, a Work object, gloo's threads); here a step is a pickle and two stores into memory
the followers already map, the scheme of vLLM's `shm_broadcast.MessageQueue`.

Segment layout (`multiprocessing.shared_memory`, created and unlinked by the writer; all counters
are aligned int64 words):

    [header 64 B: magic, num_readers, num_slots, slot_bytes, writer pid]
    [reader r, 64 B each: ack (the last sequence number it consumed), pid]
    [slot s, slot_bytes each: seq, total message length, payload (slot_bytes - 16 B)]

Every slot write takes the next sequence number m (from 1) and goes to slot (m - 1) % num_slots. The
writer copies the payload, then the length, then stores m in the slot's `seq` last; a reader waiting
for m reads the slot once it sees seq == m, then stores m in its ack word. The writer reuses a slot
(for m + num_slots) only when every reader's ack is >= m, so one ack counter per reader covers all
slots (readers consume in order). A message longer than one slot's payload spans consecutive slots
(each holds the next piece under its own number, each carries the total length), so its size is
unbounded: the writer streams the pieces as readers free the slots. A step message of a decode batch
(a few KiB) takes one slot.

Memory ordering: Python writes the shared memory with plain loads and stores through a memoryview.
The scheme relies on x86-64's total store order (stores become visible to other cores in program
order, loads are not reordered with older loads): a reader that sees seq == m sees the payload
written before it, and the writer that sees a reader's ack sees that reader done with the slot.
CPython issues the payload copy and the seq store in separate C calls, so the compiler can't reorder
them either. `usable()` is False on other architectures, where the caller uses its gloo broadcast.

Waiting: a reader spins (os.sched_yield) for `SPIN_S`, then sleeps in steps that grow with the time
already waited, up to 1 ms, so an idle server costs a follower about nothing while a step that comes
within the spin window is picked up at once. A follower's host runs ahead of its GPU, so its wait
for the next step spans the GPU's step: the spin window (20 ms) covers a decode step, and past it a
late wake-up costs at most ~1% of the time waited. A reader checks every second that the writer's
process still exists. The writer, waiting for a slot, checks the readers' processes every 50 ms
(`WorkerDied` at once when one is gone) and gives up after `timeout_s` (`WorkerDied` naming the
reader that holds the slot).
"""

from __future__ import annotations

import os
import pickle
import platform
import secrets
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from pieceworks.parallel.workers import WorkerDied

MAGIC = 0x70776D7100000001  # "pwmq", layout 1
HEADER_BYTES = 64
READER_BYTES = 64
SLOT_HEAD_BYTES = 16
NUM_SLOTS = 8
SLOT_BYTES = 64 * 1024
SPIN_S = 0.02  # reader: yield-spin this long before sleeping (see the module docstring)
MAX_SLEEP_S = 1e-3
WRITER_SPIN_S = 1e-4
LIVENESS_S = 1.0  # reader: how often it checks the writer's process while waiting
READER_LIVENESS_S = 0.05  # writer: how often it checks the readers' processes while waiting for a slot


def usable() -> bool:
    """Whether this host can run the queue: x86-64 (the memory-ordering argument above) with POSIX
    shared memory."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a killed child of ours that nobody has
    reaped yet still answers kill(pid, 0))."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: existence only
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment without registering it with this process's resource tracker: the
    writer owns it. (Before Python 3.13 attaching registers it, and a tracker that outlives the
    reader would unlink the writer's segment; workers share the leader's tracker, so
    unregistering afterwards would drop the writer's own registration.)"""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        register = resource_tracker.register
        resource_tracker.register = lambda *args, **kwargs: None
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register


class MessageQueue:
    """One end of the ring: the writer (`MessageQueue.create`) or a reader (`MessageQueue.attach`).

    `put(obj)` on the writer, `get()` on each reader: every reader gets every object, in order.
    Objects travel as pickles (protocol 5); any size (see the module docstring for how a long
    message spans slots)."""

    def __init__(self, shm: shared_memory.SharedMemory, reader: int | None, timeout_s: float) -> None:
        self.shm = shm
        self.name = shm.name
        self.reader = reader  # None on the writer
        self._unlinked = reader is not None  # only the writer removes the name
        self._writer_is_parent = False
        self.timeout_s = timeout_s
        self._buf = shm.buf
        self._words = shm.buf.cast("q")
        w = self._words
        if w[0] != MAGIC:
            self.close()
            raise RuntimeError(f"shared memory segment {self.name!r} is not a pieceworks message queue")
        self.num_readers, self.num_slots, self.slot_bytes, self.writer_pid = w[1], w[2], w[3], w[4]
        self._ack = [(HEADER_BYTES + r * READER_BYTES) // 8 for r in range(self.num_readers)]
        self._pid = [i + 1 for i in self._ack]
        first_slot = HEADER_BYTES + self.num_readers * READER_BYTES
        slots = [first_slot + s * self.slot_bytes for s in range(self.num_slots)]  # byte offsets
        self._seq = [off // 8 for off in slots]  # word index of each slot's seq (its length follows)
        self._payload = [off + SLOT_HEAD_BYTES for off in slots]
        self._cap = self.slot_bytes - SLOT_HEAD_BYTES
        self._next = 1  # sequence number of the next slot to write or read
        # writer: numbers up to this one go into slots every reader is done with (no reader: all)
        self._free_until = self.num_slots if self.num_readers else float("inf")

    @property
    def count(self) -> int:
        """Slots written (writer) or consumed (reader) so far: one per message, more for long ones."""
        return self._next - 1

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, num_readers: int, timeout_s: float, num_slots: int = NUM_SLOTS,
               slot_bytes: int = SLOT_BYTES) -> "MessageQueue":
        """The writer's end: a new segment for `num_readers` readers (0 is allowed: every `put` still
        pickles and writes its slot). `timeout_s` bounds the wait for a free slot."""
        if slot_bytes % 64 or slot_bytes <= SLOT_HEAD_BYTES:
            raise ValueError(f"slot_bytes: {slot_bytes} must be a multiple of 64 and > {SLOT_HEAD_BYTES}")
        if num_slots < 1 or num_readers < 0:
            raise ValueError(f"num_slots: {num_slots} must be >= 1, num_readers: {num_readers} >= 0")
        size = HEADER_BYTES + num_readers * READER_BYTES + num_slots * slot_bytes
        shm = shared_memory.SharedMemory(name=f"pieceworks-mq-{os.getpid()}-{secrets.token_hex(4)}", create=True,
                                         size=size)
        words = shm.buf.cast("q")
        words[1], words[2], words[3], words[4] = num_readers, num_slots, slot_bytes, os.getpid()
        words[0] = MAGIC  # last: a reader that attaches checks it
        words.release()
        return cls(shm, None, timeout_s)

    @classmethod
    def attach(cls, name: str, reader: int, timeout_s: float | None = None) -> "MessageQueue":
        """Reader `reader` (0 .. num_readers-1) of the writer's segment `name`; it records its pid, by
        which the writer notices it is gone. `timeout_s` bounds each `get` (None: wait as long as the
        writer's process lives)."""
        q = cls(_attach(name), reader, timeout_s)
        if not 0 <= reader < q.num_readers:
            q.close()
            raise ValueError(f"reader {reader} of a queue with {q.num_readers} readers")
        q._words[q._pid[reader]] = os.getpid()
        q._writer_is_parent = os.getppid() == q.writer_pid
        return q

    # ------------------------------------------------------------------ writer
    def put(self, obj: Any) -> None:
        """Write `obj` for every reader. Returns once it is in the ring (readers need not have read it).

        Raises:
            WorkerDied: a reader's process is gone, or a reader has not freed the slot within
                `timeout_s`.
        """
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        total = len(data)
        if total > self._cap:
            return self._put_pieces(data)
        m = self._next
        if m > self._free_until:
            self._wait_free(m - self.num_slots)
        slot = (m - 1) % self.num_slots
        start = self._payload[slot]
        self._buf[start:start + total] = data
        seq = self._seq[slot]
        self._words[seq + 1] = total
        self._words[seq] = m  # after the payload: a reader that sees m sees the payload (TSO)
        self._next = m + 1

    def _put_pieces(self, data: bytes) -> None:
        """`put` of a message longer than one slot: consecutive slots, each with the next piece."""
        total, cap, view = len(data), self._cap, memoryview(data)
        for pos in range(0, total, cap):
            m = self._next
            if m > self._free_until:
                self._wait_free(m - self.num_slots)
            slot = (m - 1) % self.num_slots
            n = min(total - pos, cap)
            self._buf[self._payload[slot]:self._payload[slot] + n] = view[pos:pos + n]
            self._words[self._seq[slot] + 1] = total
            self._words[self._seq[slot]] = m
            self._next = m + 1

    def _wait_free(self, oldest: int) -> None:
        """Until every reader has consumed sequence number `oldest` (the slot's previous content);
        then `_free_until` is the last number that can be written without looking at the acks again."""
        words = self._words
        start = time.monotonic()
        next_check = start + READER_LIVENESS_S
        while True:
            behind = [r for r, i in enumerate(self._ack) if words[i] < oldest]
            if not behind:
                self._free_until = min(words[i] for i in self._ack) + self.num_slots
                return
            now = time.monotonic()
            if now - start < WRITER_SPIN_S:
                os.sched_yield()
                continue
            if now >= next_check:
                next_check = now + READER_LIVENESS_S
                for r in behind:
                    pid = words[self._pid[r]]
                    if pid and not process_alive(pid):
                        raise WorkerDied(f"message queue reader {r} (pid {pid}) exited without reading message "
                                         f"{oldest}")
            if now - start > self.timeout_s:
                r = behind[0]
                raise WorkerDied(f"message queue reader {r} (pid {words[self._pid[r]] or 'not attached'}) has not "
                                 f"read message {oldest} within {self.timeout_s:g} s (parallel.timeout_s): it is "
                                 "stuck or gone")
            time.sleep(min(MAX_SLEEP_S, (now - start) * 0.01))

    # ------------------------------------------------------------------ reader
    def get(self) -> Any:
        """The writer's next object.

        Raises:
            RuntimeError: the writer's process is gone, or (with a `timeout_s`) nothing came in time.
        """
        m = self._next
        slot = (m - 1) % self.num_slots
        seq = self._seq[slot]
        words = self._words
        if words[seq] != m:
            self._wait_written(seq, m)
        total = words[seq + 1]
        start = self._payload[slot]
        if total <= self._cap:
            obj = pickle.loads(self._buf[start:start + total])
            self._next = m + 1
            words[self._ack[self.reader]] = m  # after the read: the writer may reuse the slot now
            return obj
        data = bytearray(total)
        for pos in range(0, total, self._cap):
            if pos:
                slot = (m - 1) % self.num_slots
                seq, start = self._seq[slot], self._payload[slot]
                if words[seq] != m:
                    self._wait_written(seq, m)
            n = min(total - pos, self._cap)
            data[pos:pos + n] = self._buf[start:start + n]
            words[self._ack[self.reader]] = m
            m += 1
            self._next = m
        return pickle.loads(data)

    def _wait_written(self, seq_word: int, m: int) -> None:
        words = self._words
        start = time.monotonic()
        next_check = start + LIVENESS_S
        while words[seq_word] != m:
            now = time.monotonic()
            waited = now - start
            if waited < SPIN_S:
                os.sched_yield()
                continue
            if now >= next_check:
                next_check = now + LIVENESS_S
                # a worker whose parent (the writer) died is re-parented: that also holds if its pid is reused
                if (os.getppid() != self.writer_pid) if self._writer_is_parent else not process_alive(self.writer_pid):
                    raise RuntimeError(f"the tensor-parallel leader (pid {self.writer_pid}) exited; message {m} "
                                       "will not come")
            if self.timeout_s is not None and waited > self.timeout_s:
                raise RuntimeError(f"no message {m} from the leader (pid {self.writer_pid}) within "
                                   f"{self.timeout_s:g} s")
            time.sleep(min(MAX_SLEEP_S, waited * 0.01))

    # ------------------------------------------------------------------ cleanup
    def close(self) -> None:
        """Unmap the segment; the writer also removes its name (readers that still map it keep their
        mapping). Idempotent."""
        if self._words is not None:
            self._words.release()
            self._words = self._buf = None
            self.shm.close()
        if not self._unlinked:
            self._unlinked = True
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


__all__ = ["MessageQueue", "usable", "process_alive", "NUM_SLOTS", "SLOT_BYTES"]
