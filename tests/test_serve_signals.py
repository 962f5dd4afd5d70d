"""plait serve's stop signals on rank 0: SIGINT and SIGTERM reach the engine at once, whatever the main thread is
doing; the launcher's end of a failed job is no request to stop (and sets the rank's end: test_launch.py's
test_the_launcher_s_end_of_a_failed_job_ends_workers_waiting_on_live_peers)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest


def test_a_stop_signal_reaches_the_engine_while_the_main_thread_is_inside_a_c_call():
    """Rank 0 acts on SIGTERM in its signal thread: /health says "stopping" at once even when the main thread is
    in a long step or a collective (here: libc's sleep with SIGTERM blocked, so no Python handler runs there)."""
    import ctypes

    from plait.serve.job import StopSignals

    class Draining:
        called: tuple[str, float, float] | None = None

        def request_stop(self, reason: str, grace: float) -> None:
            self.called = (reason, grace, time.monotonic())

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signals = StopSignals(leader=True)
    engine = Draining()
    signals.attach(engine, 7.0)
    sent: list[float] = []

    def send() -> None:
        time.sleep(0.2)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        threading.Thread(target=send).start()
        ctypes.CDLL(None).sleep(2)  # the main thread: in C for 2 s, as in a step
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        signals.close()
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert engine.called is not None and engine.called[:2] == ("SIGTERM", 7.0)
    assert engine.called[2] - sent[0] < 1.0, "the stop waited for the main thread"


@pytest.mark.parametrize("forwarded", [False, True])
def test_the_launcher_s_end_of_a_failed_job_is_no_stop_request_while_loading(tmp_path, monkeypatch, capsys, forwarded):
    """When a rank fails while the model loads, the launcher ends the job with SIGTERM to the workers left: rank 0
    says nothing of stopping (the failed rank's error is the job's one line) and sets its own end ``FAILED_END_S``
    later. A SIGTERM its launcher passed on (``signal-15`` beside the failure) is a request to stop: rank 0 says so
    and sets no end."""
    from plait.distributed import job_signals
    from plait.distributed.job_signals import FAILED_END_S, JOB_DIR_ENV
    from plait.serve.job import StopSignals

    (tmp_path / "rank1").write_text("ConfigError\nthe file was damaged")
    if forwarded:
        (tmp_path / f"signal-{int(signal.SIGTERM)}").touch()
    monkeypatch.setenv(JOB_DIR_ENV, str(tmp_path))
    ends: list[tuple[float, int, str]] = []
    monkeypatch.setattr(job_signals, "end_after",  # not pytest's end
                        lambda seconds, status, said: ends.append((seconds, status, said)))
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signals = StopSignals(leader=True)  # rank 0 before its engine exists: the model still loading
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while not signals.reason and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # the signal thread prints, if it does, as it notes the signal
    finally:
        signals.close()
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
    said = capsys.readouterr().err
    assert signals.reason == "SIGTERM"
    assert said == ("plait serve: SIGTERM: stopping once the model has loaded\n" if forwarded else ""), said
    assert ends == ([] if forwarded else [(FAILED_END_S, 128 + signal.SIGTERM, "")])  # the launcher names the rank

