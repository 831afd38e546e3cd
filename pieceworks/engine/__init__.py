"""The request layer: sampling parameters, the batched device sampler, and (above the executor) the
engine that schedules requests. Imports only executor/ and the layers below it."""

from pieceworks.engine.params import SamplingParams

__all__ = ["SamplingParams"]
