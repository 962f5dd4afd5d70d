"""``run_world``'s two ways of starting a world: fresh interpreters (spawn), or forks of one server that has
imported the heavy modules once (``preload``), each seeing the caller's environment as at its launch; the jobs of
``launch`` (plait train, generate, serve), forked from that server, the same."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import alive
from plait.distributed.launch import LaunchError, child_pids, launch, run_world, worker_pids


def _rank_facts(name: str) -> dict:
    """A rank's environment variable ``name``, world, rank and parent. It leaves the world only once every rank has
    joined it (the barrier): Gloo's start-up returns on one rank before its peer has finished connecting, and a rank
    that exits at once closes the connection its peer is still setting up ("Connection closed by peer")."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    return {"mark": os.environ.get(name), "world": dist.get_world_size(), "rank": dist.get_rank(),
            "parent": os.getppid()}


def test_preloaded_worlds_fork_from_one_server_with_the_callers_environment(monkeypatch):
    monkeypatch.setenv("PLAIT_TEST_MARK", "first")
    first = run_world(_rank_facts, 2, "PLAIT_TEST_MARK", preload=("torch",), timeout_s=120)
    monkeypatch.setenv("PLAIT_TEST_MARK", "second")  # after the server started: it must still reach the ranks
    second = run_world(_rank_facts, 2, "PLAIT_TEST_MARK", preload=("torch",), timeout_s=120)
    assert [f["mark"] for f in first] == ["first"] * 2 and [f["mark"] for f in second] == ["second"] * 2
    assert [(f["rank"], f["world"]) for f in first + second] == [(0, 2), (1, 2)] * 2
    parents = {f["parent"] for f in first + second}
    assert len(parents) == 1 and os.getpid() not in parents  # every rank forked by the one server


def test_spawned_worlds_are_children_of_the_caller(monkeypatch):
    monkeypatch.setenv("PLAIT_TEST_MARK", "spawned")
    facts = run_world(_rank_facts, 2, "PLAIT_TEST_MARK", timeout_s=120)
    assert [(f["mark"], f["rank"], f["parent"]) for f in facts] == [("spawned", r, os.getpid()) for r in (0, 1)]


def _rank_in_a_group() -> int:
    """Joins the world's default group (rank 0 binds the rendezvous port) and leaves it."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


def test_a_world_whose_rendezvous_port_was_taken_is_launched_again_on_another(monkeypatch):
    """free_port's port is free when picked; another process may bind it before rank 0 does (seen under load, with
    other test runs on the host: plait verify failed with rank 0's EADDRINUSE). The world is launched again on a
    fresh port."""
    import socket

    from plait.distributed import launch as launch_module

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = launch_module.free_port
    monkeypatch.setattr(launch_module, "free_port", lambda: next(ports, None) or real())
    try:
        assert run_world(_rank_in_a_group, 2, timeout_s=120, preload=("torch",)) == [0, 1]
    finally:
        taken.close()


def _one_rank_ends_without_a_report(code: int, pause_s: float, noted: str) -> int:
    """Rank 1 waits ``pause_s``, notes the time (time.monotonic(), one clock for the host) in ``noted`` and exits
    with ``code`` without reporting; rank 0 reports at once."""
    import time

    if os.environ["RANK"] == "1":
        time.sleep(pause_s)
        Path(noted).write_text(repr(time.monotonic()))
        os._exit(code)
    return 0


def test_a_rank_that_ends_without_a_report_is_seen_at_once(tmp_path):
    """Its pipe is read as its process ends: the world returns within moments of the death (not after polling
    and a grace period, a second a launch in the fault tests), and a rank gone with exit status 0 is named as
    gone, not waited on until the deadline. The fastest of up to three launches counts: other jobs on the
    cores can keep the caller from a core for a moment (polling with its grace period is slow in every one)."""
    import time

    noted = tmp_path / "died"
    after: list[float] = []  # seconds from the rank's end to run_world's return, per launch
    while len(after) < 3 and not (after and min(after) < 0.4):
        world = run_world(_one_rank_ends_without_a_report, 2, 3, 1.0, str(noted), allow_dead=True, timeout_s=60,
                          preload=("torch",))
        after.append(time.monotonic() - float(noted.read_text()))
        assert world == [0, None]
    assert min(after) < 0.4, after
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"^ranks \[1\] died \(exit codes \[0\]\) without reporting$"):
        run_world(_one_rank_ends_without_a_report, 2, 0, 0.0, str(noted), timeout_s=30, preload=("torch",))
    assert time.monotonic() - t0 < 20


def job_facts(payload: dict) -> dict:
    """A job's worker (``launch``): its environment, rank, parent, and the workers ``worker_pids`` finds."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()  # every worker alive
    found = worker_pids(payload["launcher"])
    dist.barrier()
    return {"mark": os.environ.get("PLAIT_TEST_MARK"), "rank": dist.get_rank(), "world": dist.get_world_size(),
            "agent": "TORCHELASTIC_RUN_ID" in os.environ, "pid": os.getpid(), "parent": os.getppid(), "found": found}


def test_launched_jobs_fork_from_the_server_with_the_callers_environment(monkeypatch):
    monkeypatch.setenv("PLAIT_TEST_MARK", "first")
    first = launch("test_launch:job_facts", {"launcher": os.getpid()}, 2)
    monkeypatch.setenv("PLAIT_TEST_MARK", "second")  # after the server started: it must still reach the workers
    second = launch("test_launch:job_facts", {"launcher": os.getpid()}, 2)
    assert [f["mark"] for f in first] == ["first"] * 2 and [f["mark"] for f in second] == ["second"] * 2
    assert [(f["rank"], f["world"], f["agent"]) for f in first + second] == [(0, 2, True), (1, 2, True)] * 2
    parents = {f["parent"] for f in first + second}
    assert len(parents) == 1 and os.getpid() not in parents  # every worker forked by the one server
    for job in (first, second):
        assert [f["found"] for f in job] == [sorted(f["pid"] for f in job)] * 2


def test_child_pids_lists_live_children_by_command_line():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "plait-child-pids-mark"])
    try:
        assert sleeper.pid in child_pids(os.getpid())
        assert child_pids(os.getpid(), b"plait-child-pids-mark") == [sleeper.pid]
        assert child_pids(os.getpid(), b"no-such-mark") == []
        sleeper.kill()
        sleeper.wait(timeout=30)  # reaped: gone from the list
        assert sleeper.pid not in child_pids(os.getpid())
    finally:
        if sleeper.poll() is None:
            sleeper.kill()


# a fork server that imports a module whose atexit hook (registered before plait's) writes the file it names
SERVER = """
import multiprocessing as mp, sys
from multiprocessing import forkserver
mp.get_context("forkserver").set_forkserver_preload(sys.argv[1:])
forkserver.ensure_running()
"""
MARK = """
import atexit, os, pathlib
atexit.register(pathlib.Path(os.environ["MARK_FILE"]).touch)
pathlib.Path(os.environ["MARK_FILE"] + ".imported").touch()
"""


def test_the_fork_server_ends_without_the_interpreters_teardown(tmp_path):
    """With plait.distributed.fork_server among its imports, a fork server whose launcher exited ends at once: no
    later exit hook runs (nor the teardown of its modules, which held the launcher's output open ~1 s longer)."""
    from plait.distributed import fork_server

    (tmp_path / "mark_module.py").write_text(MARK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    for with_plait, mark in ((True, tmp_path / "quick"), (False, tmp_path / "torn-down")):
        preload = ["mark_module", *([fork_server.__name__] if with_plait else [])]
        done = subprocess.run([sys.executable, "-c", SERVER, *preload], env={**env, "MARK_FILE": str(mark)},
                              capture_output=True, text=True, timeout=120)  # returns once the server's output ends
        assert done.returncode == 0 and Path(f"{mark}.imported").is_file(), done.stderr
    assert not (tmp_path / "quick").exists() and (tmp_path / "torn-down").exists()


CHECKS = """
import importlib, json, os, sys
from typer.testing import CliRunner
from plait.cli.main import app
from plait.distributed.launch import child_pids
from plait.errors import ConfigError
seen = {}
def check(*args, **kw):
    seen.update(server=bool(child_pids(os.getpid(), b"forkserver")), torch="torch" in sys.modules)
    raise ConfigError("--model: refused by the test")
checked = {"train": ("plait.train", "validate"), "generate": ("plait.cli.generate", "_check_greedy"),
           "serve": ("plait.cli.serve", "_check_unread")}[sys.argv[1]]  # the first check of each command
setattr(importlib.import_module(checked[0]), checked[1], check)
res = CliRunner().invoke(app, sys.argv[1:])
print(json.dumps({**seen, "exit": res.exit_code, "output": res.output,
                  "left": child_pids(os.getpid(), b"forkserver")}))
"""


def _checked(*commands: tuple[str, ...]) -> list[dict]:
    """What ``CHECKS`` saw of each command, all run at once."""
    import json

    runs = [subprocess.Popen([sys.executable, "-c", CHECKS, *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for c in commands]
    out = []
    for run in runs:
        stdout, stderr = run.communicate(timeout=120)
        assert run.returncode == 0, stderr
        out.append(json.loads(stdout))
    return out


def test_plait_train_starts_the_fork_server_before_its_checks_and_ends_it_when_they_fail():
    """The fork server runs (importing torch for the workers) while plait train checks the run, before this
    process imports torch; a check that fails ends it. A dry run, which launches nothing, starts none; nor does
    plait generate or serve of one process (run here); of several they start it before their checks too."""
    from contextlib import nullcontext

    from plait.distributed import fork_server

    train, dry, *launching = _checked(("train",), ("train", "--dry-run"), ("generate", "--tp", "2"),
                                      ("serve", "--pp", "2"))
    assert train["server"] and not train["torch"], train
    assert train["exit"] == 2 and train["output"] == "error: --model: refused by the test\n", train
    assert dry["exit"] == 2 and not dry["server"], dry
    assert isinstance(fork_server.launching("plait.serve.job:serve_job", 1), nullcontext)  # run here
    for res in (train, *launching):
        assert res["exit"] == 2 and res["left"] == [], res
    assert all(res["server"] for res in launching), launching


def job_sleeps(payload: dict) -> None:
    """A job's worker that writes its pid, then outlives any test unless something ends it."""
    import time

    Path(payload["dir"], f"worker{os.getpid()}").write_text("")
    time.sleep(600)


LAUNCHER = """
import os, sys
sys.path.insert(0, sys.argv[2])
from plait.distributed.launch import launch
launch("test_launch:job_sleeps", {"dir": sys.argv[1]}, 2)
"""


def test_a_sigkilled_launchers_server_and_workers_end_with_it(tmp_path):
    """SIGKILL to a launcher (plait train's, serve's: no time to stop its job) ends its fork server and workers
    within seconds; they would otherwise run the job on (writing beside a restarted job) and then wait forever."""
    import signal
    import time

    from plait.distributed.launch import child_pids

    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), str(Path(__file__).parent)])
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("worker*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = [int(p.name.removeprefix("worker")) for p in tmp_path.glob("worker*")]
    servers = child_pids(proc.pid, b"multiprocessing.forkserver")
    assert len(workers) == 2 and len(servers) == 1, (workers, servers)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    left = [p for p in workers + servers if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    for pid in left:  # the old code's leftovers: end them before failing
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"left running after their launcher's SIGKILL: {left}"


def job_waits_on_a_silent_store(payload: dict) -> str:
    """A job's worker that waits 1 s for a key no one sets: c10d's C++ socket code warns of the timed-out poll
    (``socket.cpp ... waitForInput ... timed out``), as a worker waiting for a stalled peer at start-up does."""
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=1))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=1))
    try:
        client.get("never-set")
    except RuntimeError:
        return "timed out"
    return "answered"


@pytest.mark.parametrize("debug", [False, True])
def test_launched_workers_keep_c10d_s_cpp_warnings_to_plait_debug(debug):
    """plait's one-line error says which rank waited on what: the C++ warnings above it said it again, twice a wait
    (PLAIT_DEBUG=1 keeps them)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PLAIT_DEBUG", "TORCH_CPP_LOG_LEVEL")}
    if debug:
        env["PLAIT_DEBUG"] = "1"
    code = ("from plait.distributed.launch import launch\n"
            "print(launch('test_launch:job_waits_on_a_silent_store', {}, 1))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "['timed out']", (proc.stdout, proc.stderr[-3000:])
    assert ("waitForInput" in proc.stderr) == debug, proc.stderr[-3000:]


def job_waits_on_a_live_peer(payload: dict) -> None:
    """A job's worker with the stop signals of plait serve (rank 0 the leader) or of plait train (``payload["job"]``):
    once the three are connected, rank 2 notes the time and dies by SIGKILL (no failure written), and ranks 0 and 1
    each wait in a receive from the other, a wait that no peer's death ends."""
    import signal
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from plait.serve.job import StopSignals
    from plait.train.preempt import StopRequest

    rank = int(os.environ["RANK"])
    if payload["job"] == "serve":
        StopSignals(leader=rank == 0)
    else:
        StopRequest().install()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    dist.barrier()
    if rank == 2:
        Path(payload["died"]).write_text(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
    dist.recv(torch.zeros(1), src=1 - rank)


@pytest.mark.parametrize("job", ["serve", "train"])
def test_the_launcher_s_end_of_a_failed_job_ends_workers_waiting_on_live_peers(tmp_path, job):
    """After a worker's death the launcher sends SIGTERM to the workers left and kills them 30 s later (torch
    elastic); plait serve's and plait train's workers catch SIGTERM (a drain, a checkpoint), and one blocked in a
    collective with a live peer runs no handler in its main thread: its signal thread ends it ``FAILED_END_S``
    after that SIGTERM. The job names the dead rank."""
    import re
    import time

    from plait.distributed.job_signals import FAILED_END_S
    from plait.distributed.launch import JobError

    with pytest.raises(JobError) as failed:
        launch("test_launch:job_waits_on_a_live_peer", {"job": job, "died": str(tmp_path / "died")}, 3)
    took = time.monotonic() - float((tmp_path / "died").read_text())
    assert re.fullmatch(r"rank 2 \(pid \d+\) died \(signal SIGKILL\); stopped the other ranks( \[.*\])?",
                        str(failed.value)), str(failed.value)
    assert took < FAILED_END_S + 12, f"the job ended {took:.1f} s after the death"
