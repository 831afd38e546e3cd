"""GPU tests: each test's executors are released before the next test starts.

An executor's graph runners refer back to their owners (reference cycles), so its GPU memory returns
only when Python's cycle collector runs, which GPU allocations do not trigger; over tests/gpu/test_graphs.py
one process otherwise holds every executor it built (above 139 GB on an H200)."""

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
