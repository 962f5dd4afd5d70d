"""The launcher's waits on a failed job end as soon as what they wait for has happened, within their bounds: a
worker that raised exits at once unless a peer has ended (then at the launcher's SIGTERM), and a stopped worker is
continued as soon as that SIGTERM waits in it."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

from plait.distributed.job_signals import ResumeStopped, await_job_end, process_state, term_pending


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def test_a_failed_worker_exits_at_once_while_its_peers_run(tmp_path):
    peer = _sleeper()
    try:
        (tmp_path / f"pid{peer.pid}").write_text("1")
        (tmp_path / f"pid{os.getpid()}").write_text("0")
        t0 = time.monotonic()
        await_job_end(tmp_path, 5.0)
        took = time.monotonic() - t0
    finally:
        peer.kill()
        peer.wait()
    assert took < 0.5, f"waited {took:.2f} s with no peer ended"  # a fixed wait: 5 s


def test_after_a_peer_ended_a_failed_worker_waits_for_the_launchers_sigterm_or_its_bound(tmp_path):
    peer = _sleeper()
    peer.kill()  # not reaped: a zombie, as a killed worker is until its parent takes its status
    (tmp_path / f"pid{peer.pid}").write_text("1")
    try:
        while process_state(peer.pid) != "exited":
            time.sleep(0.01)
        t0 = time.monotonic()
        await_job_end(tmp_path, 0.5)
        bounded = time.monotonic() - t0
        original = signal.getsignal(signal.SIGTERM)

        def launcher_ends_the_job() -> None:  # once the wait's handler is in place
            while signal.getsignal(signal.SIGTERM) is original:
                time.sleep(0.005)
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=launcher_ends_the_job, daemon=True).start()
        t0 = time.monotonic()
        await_job_end(tmp_path, 30.0)
        ended = time.monotonic() - t0
    finally:
        peer.wait()
    assert 0.5 <= bounded < 2.0, bounded
    assert 0.2 <= ended < 3.0, f"waited {ended:.2f} s after the SIGTERM"  # a fixed wait: 30 s
    assert signal.getsignal(signal.SIGTERM) is original


def test_a_stopped_worker_is_continued_when_the_launchers_sigterm_waits_in_it(tmp_path):
    (tmp_path / "rank0").write_text("ValueError\nboom")
    termed, untouched = _sleeper(), _sleeper()
    try:
        for p in (termed, untouched):
            os.kill(p.pid, signal.SIGSTOP)
        while any(process_state(p.pid) != "stopped" for p in (termed, untouched)):
            time.sleep(0.01)
        with ResumeStopped(tmp_path, lambda: [termed.pid, untouched.pid], 30.0) as watch:
            time.sleep(0.3)
            assert watch.continued == [] and not term_pending(untouched.pid)
            t0 = time.monotonic()
            os.kill(termed.pid, signal.SIGTERM)
            termed.wait(timeout=20)
            took = time.monotonic() - t0
            assert process_state(untouched.pid) == "stopped"  # no SIGTERM: left until the bound
        assert watch.continued == [termed.pid] and termed.returncode == -signal.SIGTERM
        assert took < 2.0, f"continued {took:.2f} s after its SIGTERM"  # a fixed wait: 30 s after the failure
        with ResumeStopped(tmp_path, lambda: [untouched.pid], 0.3) as bounded:
            time.sleep(1.0)
        assert bounded.continued == [untouched.pid] and process_state(untouched.pid) != "stopped"
    finally:
        for p in (termed, untouched):
            p.kill()
            p.wait()
