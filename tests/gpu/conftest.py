"""GPU tests: each test's executors are released before the next test starts.

The tests drop their executors without `close()`: torch.compile keeps each piecewise backend (and with
it the executor's model, pool and graphs) until `torch._dynamo.reset()`, and the graph runners refer back
to their owners (cycles only the collector frees, which GPU allocations do not trigger). Over
tests/gpu/test_graphs.py one process otherwise holds every executor it built (above 139 GB on an H200)."""

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def release_gpu_memory():
    yield
    if torch.cuda.is_available():
        torch._dynamo.reset()  # compiled code caches hold the models they were traced from
        gc.collect()
        torch.cuda.empty_cache()
