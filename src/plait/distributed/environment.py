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


def local_rank(launched: tuple[int, int] | None, devices: int | None = None) -> int:
    """The index among this host's processes, and so of the accelerator, that this process takes: LOCAL_RANK as its
    launcher set it; 0 for a process alone (``launched`` None, or a world of one); RANK modulo LOCAL_WORLD_SIZE
    where LOCAL_RANK is not set but LOCAL_WORLD_SIZE is (torchrun numbers ranks host by host). Any other launched
    process is a ConfigError naming LOCAL_RANK and how to launch, before any collective: taken as 0, every process
    of a host would share its first device. ``devices``, when given (the accelerators this process sees), bounds
    it: a LOCAL_RANK past them is a ConfigError too."""
    if "LOCAL_RANK" in os.environ:
        local = env_int("LOCAL_RANK")
    elif launched is None or launched[1] == 1:
        local = 0
    elif "LOCAL_WORLD_SIZE" in os.environ:
        per_host = env_int("LOCAL_WORLD_SIZE")
        if per_host < 1 or launched[1] % per_host:
            raise ConfigError(f"environment variable LOCAL_WORLD_SIZE={per_host}: must be a positive divisor of "
                              f"WORLD_SIZE={launched[1]} to give LOCAL_RANK (which is not set)")
        local = launched[0] % per_host
    else:
        rank, world = launched
        raise ConfigError(
            f"environment variable LOCAL_RANK is not set, while RANK={rank} and WORLD_SIZE={world} are: it names "
            f"the device this process takes on its host, and taken as 0 every process of a host would share the "
            f"first one. Launch with torchrun, which sets it in each process, e.g. torchrun --nproc-per-node "
            f"{min(world, 8)} script.py; or set LOCAL_RANK (under Slurm: LOCAL_RANK=$SLURM_LOCALID), or "
            f"LOCAL_WORLD_SIZE (the processes per host) in each process")
    if local < 0:
        raise ConfigError(f"environment variable LOCAL_RANK={local}: must be >= 0")
    if devices is not None and local >= devices:
        raise ConfigError(f"environment variable LOCAL_RANK={local}: this process sees {devices} device"
                          f"{'s' * (devices != 1)} (0 to {devices - 1}); run at most {devices} processes a host "
                          f"(torchrun --nproc-per-node {devices}), or make more visible (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    return local
