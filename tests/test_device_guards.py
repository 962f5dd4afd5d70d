"""Guards of the GPU path that run without a GPU: no CPU-only device literal in runtime code beyond the listed
ones, and the launcher's ``LOCAL_RANK`` choosing the GPU when CUDA is there (torch.cuda mocked)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from plait.errors import ConfigError

SRC = Path(__file__).resolve().parents[1] / "src" / "plait"
#: packages that import no torch (they describe devices, they never place tensors)
PURE = ("plan", "sim", "schedules")
CPU_LITERAL = re.compile(r"""["']cpu["']|\.cpu\(\)|device\(\s*["']cpu""")
#: file -> (how many CPU literals it may hold, why each is right on a GPU too)
ALLOWED: dict[str, tuple[int, str]] = {
    "devices.py": (7, "the device-type tests themselves (host copies count only from a non-CPU device)"),
    "distributed/default_group.py": (2, "Gloo's device is the CPU, and a process's where there is no GPU"),
    "calibrate/__init__.py": (2, "host facts: the processor's name under the key 'cpu', and 'cpu' as the device "
                                 "name when there is no GPU"),
    "optim/optimizer.py": (1, "the device types with torch's fused AdamW kernel"),
    "generation/decode.py": (5, "the sampler draws on the host from one seeded generator (the same tokens on any "
                                "device) and the finished token ids are kept on the host to become text"),
    "parallel_model.py": (1, "full_state_dict returns host tensors (documented), for saving and comparing"),
    "checkpoint/writer.py": (1, "a checkpoint is written from host copies of the shards (taken before the "
                                "background write, so training goes on)"),
    "models/hf.py": (1, "safetensors writes host tensors"),
    "checkpoint/checksums.py": (1, "a checksum is taken of a tensor's bytes on the host (zlib), as a shard file holds "
                                   "them"),
    "pipeline/p2p.py": (2, "a GPU's pipeline messages are staged through host buffers for Gloo's tag matching"),
    "cli/calibrate.py": (1, "the host facts' processor name, shown in a table"),
    "cli/auto_layout.py": (1, "the planner catalogue's entry for a CPU host (auto layout on CPU processes)"),
}


def _counts() -> dict[str, int]:
    found: dict[str, int] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.split("/")[0] in PURE:
            continue
        n = sum(len(CPU_LITERAL.findall(line.split("#")[0])) for line in path.read_text().splitlines())
        if n:
            found[rel] = n
    return found


def test_no_cpu_only_device_literal_beyond_the_listed_ones():
    found = _counts()
    extra = {f: n for f, n in found.items() if n > ALLOWED.get(f, (0, ""))[0]}
    assert not extra, (f"CPU device literals in runtime code: {extra}. Place tensors on the context's device "
                       "(ctx.device, a parameter's device), or add the file to ALLOWED with the reason it is "
                       "right on a GPU too")
    stale = {f for f, (n, _) in ALLOWED.items() if found.get(f, 0) < n}
    assert not stale, f"ALLOWED lists more literals than these files hold now (lower the counts): {stale}"


def test_no_unconditional_cuda_calls_outside_the_device_module():
    """``torch.cuda.*`` only where the code asked first whether the device is a GPU (devices.py, the launcher,
    the calibration's host facts)."""
    allowed = {"devices.py", "distributed/default_group.py", "calibrate/__init__.py"}
    calls = {path.relative_to(SRC).as_posix() for path in SRC.rglob("*.py")
             if "torch.cuda." in path.read_text()}
    assert calls <= allowed, calls - allowed


def test_local_rank_picks_the_gpu(monkeypatch):
    """With CUDA and NCCL present, a worker takes GPU ``LOCAL_RANK`` before the process group starts and its
    context's device is that GPU; without CUDA it is the CPU under Gloo."""
    import torch.distributed as dist

    from plait.distributed import default_group

    chosen: list[int] = []
    inited: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: chosen.append(int(i)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: inited.append(backend))
    torchrun = {"LOCAL_RANK": "3", "RANK": "7", "WORLD_SIZE": "8", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    default_group.ensure_default_group(10.0)
    assert chosen == [3] and inited == ["nccl"]
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: chosen[-1])
    assert default_group.default_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    assert default_group.default_device() == torch.device("cpu")


    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # a launch that leaves the device to a guess: refused
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="LOCAL_RANK is not set, while RANK=7 and WORLD_SIZE=8 are"):
        default_group.ensure_default_group(10.0)
    assert chosen == [3] and inited == ["nccl"]


@pytest.mark.filterwarnings("ignore:.*copying from a non-meta parameter:UserWarning")  # the meta stand-in below
def test_a_model_served_or_generated_by_one_process_goes_to_its_gpu(monkeypatch, tmp_path):
    """``plait serve`` and ``plait generate`` with one process (tp 1, pp 1: no process group) load the model onto
    this process's device, its GPU (LOCAL_RANK's, else GPU 0) where CUDA is there: they left it on the CPU."""
    from plait.distributed import default_group
    from plait.generation.job import load_model
    from plait.models import Llama, LlamaConfig

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert default_group.process_device() == torch.device("cpu") or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert default_group.process_device() == torch.device("cuda", 0)  # a process alone
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert default_group.process_device() == torch.device("cuda", 2)
    Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16)).save_pretrained(
        tmp_path)
    placed: list[torch.device] = []
    chosen = default_group.process_device

    def meta() -> torch.device:  # stands in for the GPU: where the weights are made tells where they went
        placed.append(chosen())
        return torch.device("meta")

    monkeypatch.setattr(default_group, "process_device", meta)
    model = load_model(str(tmp_path))[0]
    assert placed == [torch.device("cuda", 2)] and {p.device.type for p in model.parameters()} == {"meta"}


@pytest.mark.parametrize("env,launched,devices,expect", [
    ({"LOCAL_RANK": "3"}, (7, 8), 4, 3),  # the launcher's word
    ({}, None, 1, 0),  # a process alone
    ({}, (0, 1), 1, 0),  # a world of one
    ({"LOCAL_WORLD_SIZE": "4"}, (6, 8), 4, 2),  # torchrun numbers ranks host by host
    ({"LOCAL_WORLD_SIZE": "8"}, (6, 8), None, 6),
    ({}, (6, 8), 8, "LOCAL_RANK is not set, while RANK=6 and WORLD_SIZE=8 are: .* torchrun --nproc-per-node 8"),
    ({"LOCAL_WORLD_SIZE": "3"}, (6, 8), 8, "LOCAL_WORLD_SIZE=3: must be a positive divisor of WORLD_SIZE=8"),
    ({"LOCAL_RANK": "4"}, (4, 8), 4, r"LOCAL_RANK=4: this process sees 4 devices \(0 to 3\); run at most 4"),
    ({"LOCAL_RANK": "-1"}, (4, 8), 4, "LOCAL_RANK=-1: must be >= 0"),
    ({"LOCAL_RANK": "one"}, (4, 8), 4, "LOCAL_RANK='one': must be an integer"),
])
def test_local_rank_is_the_launchers_or_derived_never_guessed(monkeypatch, env, launched, devices, expect):
    """The device a launched process takes: LOCAL_RANK, else derived only where that is unambiguous (one process,
    or LOCAL_WORLD_SIZE given); else a ConfigError naming LOCAL_RANK and torchrun (not device 0 for every rank)."""
    from plait.distributed.environment import local_rank

    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if isinstance(expect, int):
        assert local_rank(launched, devices) == expect
    else:
        with pytest.raises(ConfigError, match=expect):
            local_rank(launched, devices)


def _local_rank() -> str:
    import os

    return os.environ["LOCAL_RANK"]


def test_the_launcher_gives_each_worker_its_local_rank():
    """plait's own launcher of local worlds sets LOCAL_RANK to the worker's index on this host (the GPU that
    ``ensure_default_group`` then takes); torchrun and plait train's elastic launcher set it themselves."""
    from plait.distributed.launch import run_world

    assert run_world(_local_rank, 2, timeout_s=120, preload=("torch",)) == ["0", "1"]


def test_gpu_pipeline_messages_are_staged_through_the_host_on_gloo(monkeypatch):
    """Under NCCL the pipeline's messages travel on a Gloo group (tags matter): a GPU transport then sends and
    receives host buffers; on a CPU, or on a group of another backend, the buffers stay on the device."""
    import torch.distributed as dist

    from plait.pipeline.p2p import Transport

    group = object()
    for backend, device, wire in (("gloo", "cuda:1", "cpu"), ("gloo", "cpu", "cpu"), ("nccl", "cuda:1", "cuda:1")):
        monkeypatch.setattr(dist, "get_backend", lambda g, b=backend: b)
        t = Transport(2, 4, torch.device(device), 10.0, group=group)  # type: ignore[arg-type]
        assert t.world is group and t.wire == torch.device(wire), (backend, device, t.wire)
