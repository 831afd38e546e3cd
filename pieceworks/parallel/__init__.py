"""Tensor and expert parallelism on torch.distributed (NCCL on CUDA, gloo on CPU).

- `layout.py`: `TPLayout` (this rank's place in the group) and `Part` (which slice of a full tensor
  a rank holds): the sharding rules the models and weight sources share.
- `comm.py`: the collectives as `torch.library` custom ops (`pieceworks::all_reduce`,
  `pieceworks::all_gather`) with fake implementations, so they trace into full and piecewise graphs.
- `group.py`: process-group setup (the device group for the collectives, a gloo group for the
  leader's step messages) and the launch facts (torchrun or in-process).
- `workers.py`: the worker processes of an in-process launch (start, liveness, shutdown).

This package sits below models/ and executor/ and imports neither: the worker's step loop lives in
`pieceworks.executor.distributed`.
"""
