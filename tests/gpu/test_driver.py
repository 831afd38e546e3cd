"""backends/driver.py's copies and events against torch's, on the GPU: in stream order on a side stream, and the
capture state seen inside a graph capture."""

from __future__ import annotations

import pytest
import torch

from pieceworks.backends import driver

pytestmark = pytest.mark.gpu


def test_copies_run_in_stream_order_on_the_given_stream():
    side = torch.cuda.Stream()
    host = torch.arange(4096, dtype=torch.int32).pin_memory()
    dev = torch.zeros(4096, dtype=torch.int32, device="cuda")
    out = torch.zeros(2, 1024, dtype=torch.int64, device="cuda")
    src = torch.arange(3000, 3000 + 2048, dtype=torch.int64, device="cuda")
    h2d, d2d = driver.Copy(dev, host, 4 * 1000), driver.Copy(out[1], None, 8 * 700)
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # the copies must wait behind it on this stream
        stream = driver.raw_stream(torch.device("cuda"))
        assert stream == side.cuda_stream
        h2d(stream)
        d2d(stream, src.data_ptr() + 8 * 100)
    side.synchronize()
    assert torch.equal(dev[:1000].cpu(), torch.arange(1000, dtype=torch.int32)) and not dev[1000:].any()
    assert torch.equal(out[1, :700], src[100:800]) and not out[0].any() and not out[1, 700:].any()


def test_event_waits_for_the_work_before_its_record_and_sees_a_capture():
    event, flag = driver.Event(), torch.zeros(1, device="cuda")
    stream = driver.raw_stream(torch.device("cuda"))
    torch.cuda._sleep(20_000_000)
    flag.fill_(1.0)
    assert not event.capturing(stream)
    event.record(stream)
    assert not torch.cuda.current_stream().query()  # the sleep is still running
    event.synchronize()
    assert torch.cuda.current_stream().query()  # nothing was queued after the record
    assert flag.item() == 1.0
    graph, seen = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        seen.append(event.capturing(driver.raw_stream(torch.device("cuda"))))
        flag.add_(1.0)
    assert seen == [True]
