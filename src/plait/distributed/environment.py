"""The launcher's environment of this process (torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), read and
checked before the default process group is made."""

from __future__ import annotations

import os

from plait.errors import ConfigError

#: what every process of a launched world needs: its rank, the world's size and where the rendezvous store listens
#: (torch.distributed's env:// rendezvous); torchrun sets all four in each process it starts
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def env_int(name: str, default: int | None = None) -> int:
    """Environment variable ``name`` as an integer (``default`` where it is not set); ConfigError naming it when
    it is not set and there is no default, or not an integer."""
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ConfigError(f"environment variable {name} is not set; launch with torchrun or plait's launcher")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r}: must be an integer") from None


def launched_world() -> tuple[int, int] | None:
    """This process's (rank, world size) as its launcher set them; None for a process alone, which needs no
    rendezvous: RANK and WORLD_SIZE not set (no launcher started it), or a world of one without MASTER_PORT.

    Any other world needs all of ``LAUNCH_VARIABLES``: ConfigError naming the ones missing (a process started by
    hand with WORLD_SIZE exported, or by a launcher that sets only some) and how to launch, before
    torch.distributed reads them, so before any collective."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return None
    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    if (rank, world) == (0, 1) and "MASTER_PORT" not in os.environ:
        return None
    missing = [name for name in LAUNCH_VARIABLES if name not in os.environ]
    if missing:
        given = [name for name in LAUNCH_VARIABLES if name not in missing]
        raise ConfigError(
            f"this process's launch environment is incomplete: {', '.join(f'{n}={os.environ[n]}' for n in given)} "
            f"{'is' if len(given) == 1 else 'are'} set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            f"not (every process of a world needs {', '.join(LAUNCH_VARIABLES)}): launch the script with torchrun, "
            f"which sets them in each process, e.g. torchrun --nproc-per-node {max(world, 2)} script.py; or unset "
            f"{', '.join(given)} to run it as one process")
    if not 0 <= rank < world:
        raise ConfigError(f"environment variable RANK={rank}: must be from 0 to WORLD_SIZE - 1 = {world - 1}")
    return rank, world
