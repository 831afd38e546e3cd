"""The errors pieceworks raises for what a caller can act on, one type per boundary.

Every user mistake is a `ValueError` subclass whose message names the file, key or argument, the bad
value and what is allowed. Capacity and numerical failures of a well-formed request are not user
mistakes and derive from `RuntimeError`. This module imports nothing, so every layer can raise them.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""


class CheckpointError(ValueError):
    """A model directory or checkpoint can't be loaded: a missing or mistyped config.json field, a
    missing, unexpected, misshapen or non-finite tensor. Nothing half-loaded is returned."""


class TokenizerError(CheckpointError):
    """A model directory's tokenizer files are there but don't load (corrupt, unreadable): unlike a model
    without a tokenizer, never taken as "no tokenizer" (text would silently turn into token-id mode)."""


class RequestError(ValueError):
    """A request's arguments are invalid (types, ranges, sampling parameters); refused before any
    state changed."""


class BatchError(RequestError):
    """A batch the executor can't run (bad token ids, freed or repeated sequence, too long); nothing
    was changed (the KV pool and every sequence are as they were)."""


class OutOfPages(RuntimeError):
    """The KV pool has fewer free pages than a step or request needs; nothing was allocated."""


class NonFiniteLogits(RuntimeError):
    """A step produced NaN or inf logits for some of its sequences (bad weights or numerical overflow);
    those sequences' requests fail instead of returning token 0."""


__all__ = ["ConfigError", "CheckpointError", "TokenizerError", "RequestError", "BatchError", "OutOfPages", "NonFiniteLogits"]
