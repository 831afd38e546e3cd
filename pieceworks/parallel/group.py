"""Process groups of a tensor-parallel run and how a launch finds its rank.

Two groups: the device group (NCCL on CUDA, gloo on CPU) runs the models' collectives
(`parallel.comm`); a gloo group (the control group) carries host objects, so that a step's inputs
never make a round trip through GPU memory. The leader's step messages go through a shared-memory ring
(`parallel.message_queue`) when every rank runs on the leader's host (always, for in-process
workers; under torchrun the ranks compare host names once at init), else through a gloo broadcast.
The control group has a timeout of its own (days): a follower waits for the next step as long as the
leader idles.

Under `torchrun`, the rank and world size come from torchrun's rendezvous variables (RANK, WORLD_SIZE,
LOCAL_RANK), read by `pieceworks.environment` for `torchrun_rank`; everywhere else the launcher passes
them explicitly.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pieceworks.environment import torchrun_variables
from pieceworks.errors import ConfigError
from pieceworks.parallel import message_queue
from pieceworks.parallel.message_queue import MessageQueue

log = logging.getLogger("pieceworks.parallel")

# Followers wait for the leader's next step as long as the leader idles (a server between requests):
# the control group's timeout bounds only a step message already under way, not the wait for one.
CONTROL_TIMEOUT = datetime.timedelta(days=7)
# Without the shared-memory queue, a step message (pickled tokens, cached lengths, page lists) up to this
# size goes in one broadcast of a buffer allocated once; a longer one sends its tail in a second broadcast.
MESSAGE_BYTES = 16384


def torchrun_rank(tensor_parallel_size: int) -> tuple[int, int] | None:
    """(rank, local rank) when this process was started by torchrun, else None.

    Raises:
        ConfigError: torchrun's world size is not `parallel.tensor_parallel_size`, or its variables
            are not integers.
    """
    found = torchrun_variables()
    if found is None:
        return None
    rank, world, local_rank = found
    if world != tensor_parallel_size:
        raise ConfigError(f"parallel.tensor_parallel_size: {tensor_parallel_size}, but torchrun started {world} "
                          f"processes; run torchrun --nproc-per-node {tensor_parallel_size}, or set "
                          f"parallel.tensor_parallel_size={world}")
    return rank, local_rank


@dataclass
class ProcessGroups:
    """This rank's groups. `device_group` is the name the models' collectives take; None in a group of
    one, where every collective is the identity and the models skip it (as vLLM's do)."""

    rank: int
    size: int
    device_group: str | None
    control: Any  # torch.distributed.ProcessGroup
    queue: MessageQueue | None = None  # the step messages' ring when all ranks share the leader's host
    timeout_s: float | None = None  # parallel.timeout_s: how long a build's collectives on `control` may wait

    _buf: torch.Tensor = field(default_factory=lambda: torch.zeros(MESSAGE_BYTES, dtype=torch.uint8), repr=False)
    _pending: list = field(default_factory=list, repr=False)

    def broadcast(self, obj: Any = None, wait: bool = True) -> Any:
        """The leader's `obj` on every rank (the leader passes it, the others get it).

        Through the shared-memory queue the leader returns once the pickle is in the ring (`wait` does
        not matter). Through gloo, with `wait=False`, the leader returns once the message is queued:
        gloo sends it on its own thread while the leader launches its step, and the next message (or
        `flush`) waits for it. One gloo broadcast of a preallocated buffer carries [length: int64][pickle];
        `broadcast_object_list` takes two broadcasts and fresh tensors per call. A group of one sends
        nothing."""
        if self.size == 1:
            return obj
        if self.queue is not None:
            if self.rank == 0:
                self.queue.put(obj)
                return obj
            return self.queue.get()
        buf = self._buf
        if self.rank == 0:
            self.flush()
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            head = min(len(data), MESSAGE_BYTES - 8)
            buf[:8].view(torch.int64)[0] = len(data)
            buf[8:8 + head] = torch.frombuffer(bytearray(data[:head]), dtype=torch.uint8)
            self._pending.append(dist.broadcast(buf, src=0, group=self.control, async_op=True))
            if head < len(data):
                tail = torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8)
                self._pending.append((dist.broadcast(tail, src=0, group=self.control, async_op=True), tail))
            if wait:
                self.flush()
            return obj
        dist.broadcast(buf, src=0, group=self.control)
        size = int(buf[:8].view(torch.int64)[0])
        data = bytes(buf[8:8 + min(size, MESSAGE_BYTES - 8)].numpy())
        if size > MESSAGE_BYTES - 8:
            tail = torch.empty(size - (MESSAGE_BYTES - 8), dtype=torch.uint8)
            dist.broadcast(tail, src=0, group=self.control)
            data += bytes(tail.numpy())
        return pickle.loads(data)

    def flush(self) -> None:
        """Wait until the leader's queued messages are sent (their buffers are free again)."""
        pending, self._pending = self._pending, []
        for work in pending:
            (work[0] if isinstance(work, tuple) else work).wait()

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s, on every rank (a build's question: a rank that doesn't answer
        within `timeout_s` is an error, not the control group's days-long wait for the next step)."""
        t = torch.tensor([value], dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control, async_op=True)
        if self.timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def close(self) -> None:
        """Leave the run: the leader removes the queue's shared memory, followers unmap it."""
        self._pending.clear()
        if self.queue is not None:
            self.queue.close()
            self.queue = None
        if dist.is_initialized():
            dist.destroy_process_group()


def init_groups(rank: int, size: int, device: torch.device, init_method: str, timeout_s: float) -> ProcessGroups:
    """Join the run: `init_method` is torch.distributed's (env:// under torchrun, file:// for workers
    started in-process); collectives that wait longer than `timeout_s` fail instead of hanging."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=size, timeout=timeout,
                                device_id=device)
    else:
        # N ranks share the cores: each takes its share of threads (a collective waits for the slowest
        # rank, and oversubscribed OpenMP threads spin against each other)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    groups = ProcessGroups(rank, size, dist.group.WORLD.group_name if size > 1 else None, control,
                           timeout_s=timeout_s)
    try:
        groups.queue = _open_queue(groups, timeout_s)
    except BaseException:
        groups.close()
        raise
    return groups


def _open_queue(groups: ProcessGroups, timeout_s: float) -> MessageQueue | None:
    """The shared-memory ring for the step messages, or None (gloo broadcasts) unless every rank runs
    on the leader's host, on an architecture the ring supports. The leader creates it (readers: the
    other ranks) and sends its name. A group of one has no reader and sends nothing: no ring."""
    if groups.size == 1:
        return None
    facts: list[Any] = [None] * groups.size
    dist.all_gather_object(facts, (socket.gethostname(), message_queue.usable()), group=groups.control)
    if not all(f == (facts[0][0], True) for f in facts):
        if groups.rank == 0:
            hosts = len({host for host, _ in facts})
            why = f"the ranks run on {hosts} hosts" if hosts > 1 else "this host can't run it (x86-64 and /dev/shm)"
            log.info("step messages: gloo broadcasts, not the shared-memory queue: %s", why)
        return None
    if groups.rank != 0:
        name = groups.broadcast()
        return None if name is None else MessageQueue.attach(name, groups.rank - 1)
    queue = None
    try:
        queue = MessageQueue.create(groups.size - 1, timeout_s)
        log.info("step messages: shared-memory queue %s (%d readers)", queue.name, groups.size - 1)
    except OSError as exc:  # /dev/shm full or not writable
        log.warning("step messages: gloo broadcasts, the shared-memory queue failed: %s", exc)
    try:
        groups.broadcast(queue.name if queue is not None else None)  # groups.queue is still None: through gloo
    except BaseException:
        if queue is not None:
            queue.close()
        raise
    return queue
