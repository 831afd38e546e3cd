"""Every process-environment variable pieceworks reads, each read here (only the `~` of a path the
user wrote is expanded where the path is used; see HOME below).

None of them is a switch: behaviour is configured in YAML (`pieceworks.config`). These variables carry
facts about the process that no config file can know:

- `XDG_CACHE_HOME`: where per-user caches go (the XDG Base Directory spec). `config.cache_root()`
  puts the default `runtime.cache_dir` under it (converted demo models, compiled CUDA kernels); a
  relative value is ignored, as the spec says.
- `HOME`: through `Path.home()`, the `~/.cache` fallback here; and through `Path.expanduser()` where
  a path the user wrote may start with `~` (`runtime.cache_dir` in `config.cache_root`, `model.path`
  in `models.loader`): expanding a path is Python's, not a setting, so it stays with the path.
- `RANK`, `WORLD_SIZE`, `LOCAL_RANK`: set by torchrun in each process it starts; they tell a
  tensor-parallel launch that it runs under torchrun and which rank (and GPU) it is
  (`parallel.group.torchrun_rank`). Outside torchrun the launcher passes the rank explicitly.
- `PIECEWORKS_API_KEY`: the key `pieceworks serve` requires on its /v1 routes and `pieceworks bench --url` sends,
  where --api-key is not given (`api_key`): a secret, which a command line would show to every user of the
  machine (the process list); set but empty, it is unset.

The in-process launcher's workers take the leader's environment whole (`leader_environment`, `adopt_environment`):
they fork from a server started at the first launch, whose environment is that moment's, and whatever the libraries
underneath read must be what the leader has at this launch. pieceworks reads nothing of it there.

Libraries underneath read variables of their own (torch.distributed's `env://` rendezvous reads
MASTER_ADDR and MASTER_PORT, CUDA reads CUDA_VISIBLE_DEVICES, Triton and FlashInfer their cache
directories); pieceworks neither reads nor sets those.

Each reader looks at `os.environ` when called, never at import, so a test that sets a variable sees
its effect.
"""

from __future__ import annotations

import os
from pathlib import Path

from pieceworks.errors import ConfigError

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
API_KEY_VARIABLE = "PIECEWORKS_API_KEY"


def user_cache_home() -> Path:
    """The per-user cache directory: $XDG_CACHE_HOME when it is an absolute path, else ~/.cache."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"


def torchrun_variables() -> tuple[int, int, int] | None:
    """(RANK, WORLD_SIZE, LOCAL_RANK) as ints when torchrun set all three, else None.

    Raises:
        ConfigError: one of them is not an integer.
    """
    env = os.environ
    if not all(k in env for k in TORCHRUN_VARIABLES):
        return None
    try:
        rank, world, local_rank = (int(env[k]) for k in TORCHRUN_VARIABLES)
    except ValueError:
        found = ", ".join(f"{k}={env[k]!r}" for k in TORCHRUN_VARIABLES)
        raise ConfigError(f"torchrun's variables must be integers, got {found}; launch with torchrun, or "
                          "unset them to run without it") from None
    return rank, world, local_rank


def api_key() -> str | None:
    """$PIECEWORKS_API_KEY, or None when it is unset or empty."""
    return os.environ.get(API_KEY_VARIABLE) or None


def leader_environment() -> dict[str, str]:
    """A copy of this process's environment, for workers to take (`adopt_environment`)."""
    return dict(os.environ)


def adopt_environment(env: dict[str, str]) -> None:
    """Make `env` this process's whole environment (a worker, before it imports or initializes anything more)."""
    os.environ.clear()
    os.environ.update(env)
