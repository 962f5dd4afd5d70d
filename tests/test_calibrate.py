"""plait calibrate: the host profile (TOML, the mean of calibrations, what the planner reads of it) and the
command (a world per process count, paired timings, --add, --repeat, its one-line errors)."""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

import checks_predict
from plait.calibrate import PRELOAD
from plait.cli.main import app
from plait.distributed.launch import run_world
from plait.plan.host.profile import HostProfile
from profile_util import synthetic_profile


def test_profile_round_trip(tmp_path):
    p = synthetic_profile()
    path = p.save(tmp_path / "host.toml")
    q = HostProfile.load(path)
    assert q == p and q.to_toml() == p.to_toml()
    s = q.section(4)
    assert s.collective("all_reduce", 2, 1024) == pytest.approx(1e-4)
    assert s.collective("all_reduce", 4, 0) == 0.0 and s.collective("all_reduce", 1, 1e6) == 0.0
    assert s.rates["matmul"].at(1e9, shared=True) == pytest.approx(2.5e10)
    with pytest.raises(ValueError, match="measured 1, 2, 4, 8 processes, not 3"):
        q.section(3)
    (tmp_path / "bad.toml").write_text("format = 1\n[host]\nhostname = 'x'\n[[section]]\nprocesses = 2\n")
    with pytest.raises(ValueError, match="malformed section"):
        HostProfile.load(tmp_path / "bad.toml")


def test_plan_reads_a_profile(tmp_path):
    path = synthetic_profile().save(tmp_path / "host.toml")
    r = CliRunner().invoke(app, ["plan", "--model", "small", "--gpus", "4", "--cluster", str(path),
                                 "--global-batch", "16", "--seq-len", "128", "--json", "--top", "3"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["best"] and all(e["layout"]["tp"] * e["layout"]["pp"] * e["layout"]["dp"] == 4 for e in out["best"])
    r = CliRunner().invoke(app, ["plan", "--model", "small", "--gpus", "3", "--cluster", str(path)])
    assert r.exit_code == 2 and "plait calibrate --processes 3" in r.output


def test_calibration_pairs_time_shared_as_the_slowest_process():
    """A kernel timed in the calibration's pairs: alone is rank 0's call (4 ms) with the other waiting; shared
    is the group's span, the slowest rank's call (12 ms), not rank 0's own, nor the two in turn (16 ms); the
    parts a call reports are kept, and each pair runs half as many rounds together (rounded up) as rank 0 ran
    alone. A loaded host wakes a sleeper late (a 4 ms sleep can take 9), so the figures are read against the
    calls' own times: a sleep never ends early."""
    from plait.calibrate.run import PAIRS

    calls = run_world(checks_predict.paired_sleeps, 2, timeout_s=60, preload=PRELOAD)  # forked as the calibration's own
    (calls0, alone, shared, _took0), (calls1, _a, _s, took1) = calls
    assert 0.004 <= alone[0] < min(took1)  # rank 0's sleep, shorter than any of rank 1's
    assert 0.012 <= shared[0] < sum(took1) / len(took1) + 0.003  # rank 1's, not after rank 0's 4 ms
    assert alone[1] == shared[1] == pytest.approx(0.001)
    together = calls1 - 1  # after one warm-up call each
    by_one = calls0 - 1 - together  # rank 0's rounds alone
    assert by_one >= 2 * PAIRS and by_one / 2 <= together <= by_one / 2 + PAIRS


def _scaled(profile: HostProfile, x: float, speed: float) -> HostProfile:
    """``profile`` as a calibration that met the host at ``x`` times its speed (probe mean ``speed``)."""
    return HostProfile({**profile.host, "speed_flops": speed, "speed_probes": [speed] * 3},
                       {p: s.at_speed(x, x, x) for p, s in profile.sections.items()})


def test_calibrations_average_their_times_weighted_by_how_many_each_holds(tmp_path):
    """The mean of calibrations taken at different moments: every time averaged (rates by their harmonic
    mean), a profile that is already the mean of n weighing n, and the count kept through TOML; profiles of
    different hosts or measured at different sizes are refused."""
    base = synthetic_profile(counts=(1, 4), block=True)
    fast, slow = _scaled(base, 2.0, 100.0), _scaled(base, 0.5, 25.0)
    assert HostProfile.average([fast]) == fast
    mean = HostProfile.average([fast, slow])
    assert mean.calibrations == 2 and mean.host["speed_flops"] == pytest.approx(40.0)  # 2 / (1/100 + 1/25)
    s, f, w = mean.section(4), fast.section(4), slow.section(4)
    time_of = (1 / 2 + 2) / 2  # each figure's time: half and twice the base's, averaged
    assert s.rates["matmul"].alone[0] == pytest.approx(base.section(4).rates["matmul"].alone[0] / time_of)
    assert s.rates["block"].shared[1] == pytest.approx((f.rates["block"].shared[1] + w.rates["block"].shared[1]) / 2)
    key = ("all_reduce", 4)
    assert s.collectives[key].seconds == pytest.approx(tuple((a + b) / 2 for a, b in zip(
        f.collectives[key].seconds, w.collectives[key].seconds, strict=True)))
    assert s.tp_blocks[0].seconds == pytest.approx(base.section(4).tp_blocks[0].seconds * time_of)
    assert s.op_overhead_s == pytest.approx(base.section(4).op_overhead_s * time_of)
    assert s.memory_bandwidth == pytest.approx(base.section(4).memory_bandwidth / time_of)
    # a third calibration weighs one against the two the mean already holds
    third = HostProfile.average([mean, fast])
    assert third.calibrations == 3
    assert third.section(1).op_overhead_s == pytest.approx(base.section(1).op_overhead_s * (0.5 * 2 + 2) / 3)
    assert HostProfile.load(third.save(tmp_path / "h.toml")) == third
    other = HostProfile({**fast.host, "cpu": "another cpu"}, fast.sections)
    with pytest.raises(ValueError, match="different hosts"):
        HostProfile.average([fast, other])
    r = base.section(1).rates["matmul"]
    resized = HostProfile(fast.host, {1: replace(base.section(1), rates={
        **base.section(1).rates, "matmul": type(r)((1.0, 2.0), r.alone, r.shared)})})
    with pytest.raises(ValueError, match="matmul was measured at different sizes"):
        HostProfile.average([fast, resized])
    older = HostProfile(fast.host, {p: replace(s, optimizer_s_per_tensor=0.0) for p, s in fast.sections.items()})
    with pytest.raises(ValueError, match="timed per tensor in some calibrations"):
        HostProfile.average([fast, older])


def test_tp_block_rounds_run_the_calls_asked_and_average_per_call():
    """``tp_block.measure(calls=c)`` runs each part c times per round after one warm-up call, every rank the
    same number of rounds (at least MIN_ROUNDS), and returns the mean seconds of one call over the ranks,
    whatever c is (docs/planner-log.md, entry 10, varied it): with parts that sleep 8 and 2 ms, each figure is
    its own part's mean call as the part timed itself, plus the loop around it (a sum per round would be c
    times that; the twin's figure in the layer's place, under 1 of it). A loaded host wakes a sleeper late
    (the 2 ms twin read 9 ms a call at load 10), so the figures are read against the sleeps' own times, not
    against 8 and 2 ms."""
    from plait.calibrate import tp_block

    for calls in (1, 3):
        out = run_world(checks_predict.tp_round_calls, 2, calls, timeout_s=120, preload=PRELOAD)
        assert out[0][0] == out[1][0], "both ranks run the same rounds"
        (layer_calls, twin_calls), layer_s, twin_s, _slept = out[0]
        assert layer_calls == twin_calls and (layer_calls - 1) % calls == 0
        assert tp_block.MIN_ROUNDS <= (layer_calls - 1) // calls <= tp_block.MAX_ROUNDS
        for i, figure in enumerate((layer_s, twin_s)):
            slept = sum(rank[3][i] for rank in out) / len(out)  # the part's own seconds a call, over the ranks
            assert 1 - 1e-9 <= figure / slept < 1.5, (calls, i, figure, [rank[3] for rank in out])


def test_calibrate_measures_each_process_count_in_a_world_of_its_own(monkeypatch):
    """A run of P processes is a world of P: `plait calibrate` launches each count's section in a world of that
    many processes (smallest first) and assembles the sections at their probes' mean speed."""
    import plait.calibrate as cal
    import plait.distributed.launch as launch
    from plait.calibrate.run import measure_world

    base = synthetic_profile(counts=(1, 2, 4), block=True)
    launches = []

    def fake_run_world(fn, nprocs, *args, timeout_s=300.0, **kw):
        processes, _ticks = args
        launches.append((fn, nprocs, processes))
        return [(base.section(processes), [10.0 * nprocs] * 2, [10.0 * nprocs] * 3)] + [None] * (nprocs - 1)

    monkeypatch.setattr(launch, "run_world", fake_run_world)
    said: list = []
    profile = cal._measure_once([1, 2, 4], lambda done, what: said.append((done, what)))
    assert said[:1] == [(0, "starting the processes")], said  # before the first figure: a piped run's first line
    assert [(n, p) for _, n, p in launches] == [(1, 1), (2, 2), (4, 4)]
    assert all(fn is measure_world for fn, *_ in launches)
    assert sorted(profile.sections) == [1, 2, 4]
    assert profile.host["speed_probes"] == [10.0, 10.0, 20.0, 20.0, 40.0, 40.0]
    assert profile.host["speed_flops"] == pytest.approx(70 / 3)


def test_calibrate_names_a_dead_measuring_process_in_one_line(tmp_path, monkeypatch):
    """A measuring process killed mid-calibration ends the command with the launcher's one-line reason
    (which rank, its exit code), exit code 1, no traceback and no profile written."""
    import plait.calibrate as cal
    from plait.distributed.launch import LaunchError

    def died(counts, progress):
        raise LaunchError("ranks [2] died (exit codes [-9]) without reporting")

    monkeypatch.setattr(cal, "_measure_once", died)
    out = tmp_path / "host.toml"
    r = CliRunner().invoke(app, ["calibrate", "--out", str(out)])
    assert r.exit_code == 1, r.output
    assert "error: plait calibrate: ranks [2] died (exit codes [-9])" in r.output
    assert "Traceback" not in r.output and not out.exists()


def test_calibrate_out_that_cannot_be_written_fails_before_measuring(tmp_path, monkeypatch):
    import plait.calibrate as cal

    def measured(counts, progress):
        raise AssertionError("measured before --out was checked")

    monkeypatch.setattr(cal, "_measure_once", measured)
    (tmp_path / "a-file").write_text("")
    for out, needle in ((tmp_path / "a-file" / "host.toml", "is a file, so nothing can be made under it"),
                        (tmp_path, "a folder, not a file")):
        r = CliRunner().invoke(app, ["calibrate", "--out", str(out), "--processes", "1"])
        assert r.exit_code == 2 and r.output.startswith(f"error: --out {out}: ") and needle in r.output, r.output


def test_calibrate_add_to_a_profile_measured_another_way_is_a_one_line_error(tmp_path, monkeypatch):
    """`--add` averages only calibrations measured the same way: a file whose matmul was timed at other sizes
    ends the command with exit code 2 and the reason, not a traceback, and the file is left as it was."""
    import plait.calibrate as cal

    base = synthetic_profile(counts=(1, 2), block=True)
    r = base.section(1).rates["matmul"]
    other = HostProfile(base.host, {**base.sections, 1: replace(base.section(1), rates={
        **base.section(1).rates, "matmul": type(r)((1.0, 2.0), r.alone, r.shared)})})
    out = tmp_path / "host.toml"
    other.save(out)
    before = out.read_text()
    monkeypatch.setattr(cal, "_measure_once", lambda counts, progress: base)
    r = CliRunner().invoke(app, ["calibrate", "--out", str(out), "--add", "--processes", "1", "--processes", "2"])
    assert r.exit_code == 2, r.output
    assert "error:" in r.output and "matmul was measured at different sizes" in r.output
    assert "Traceback" not in r.output and out.read_text() == before


def test_calibrate_add_and_repeat_keep_the_mean_of_the_calibrations(tmp_path, monkeypatch):
    """`plait calibrate --add` averages a new calibration into the file's; `--repeat N` keeps the mean of N
    taken back to back; without either the file is replaced (the measuring itself is stubbed: a calibration
    takes a minute, and test_train_calibrates_on_first_use_and_caches runs a real one)."""
    import plait.calibrate as cal

    base = synthetic_profile(counts=(1, 2), block=True)
    readings = iter([_scaled(base, x, 100.0 * x) for x in (2.0, 0.5, 1.0, 1.0, 0.5)])
    monkeypatch.setattr(cal, "_measure_once", lambda counts, progress: next(readings))
    out = tmp_path / "host.toml"
    r = CliRunner().invoke(app, ["calibrate", "--out", str(out), "--processes", "1", "--processes", "2"])
    assert r.exit_code == 0, r.output
    assert HostProfile.load(out).calibrations == 1
    r = CliRunner().invoke(app, ["calibrate", "--out", str(out), "--add", "--processes", "1", "--processes", "2"])
    assert r.exit_code == 0, r.output
    two = HostProfile.load(out)
    assert two.calibrations == 2 and "the mean of 2 calibrations" in r.output
    assert two.section(2).op_overhead_s == pytest.approx(base.section(2).op_overhead_s * 1.25)  # (1/2 + 2) / 2
    r = CliRunner().invoke(app, ["calibrate", "--out", str(out), "--repeat", "2", "--processes", "1",
                                 "--processes", "2"])
    assert r.exit_code == 0, r.output
    assert HostProfile.load(out).calibrations == 2  # replaced by the mean of two new ones at the base speed
    again = HostProfile.load(out).section(2)
    assert again.op_overhead_s == pytest.approx(base.section(2).op_overhead_s)
    assert again.rates["matmul"].shared == pytest.approx(base.section(2).rates["matmul"].shared)
    r = CliRunner().invoke(app, ["calibrate", "--out", str(out), "--processes", "1", "--processes", "2"])
    assert HostProfile.load(out).calibrations == 1  # no --add: replaced
    r = CliRunner().invoke(app, ["calibrate", "--out", str(out), "--repeat", "0"])
    assert r.exit_code == 2 and "--repeat" in r.output


def test_calibrate_add_to_a_missing_profile_fails_before_measuring(tmp_path, monkeypatch):
    """`--add` averages into a profile that exists: with none there (a mistyped path, or no cached profile yet)
    it stops before measuring, naming --add and the missing file, and writes nothing."""
    import plait.calibrate as cal

    def measured(counts, progress):
        raise AssertionError("measured before --add's profile was checked")

    monkeypatch.setattr(cal, "_measure_once", measured)
    out = tmp_path / "new.toml"
    r = CliRunner().invoke(app, ["calibrate", "--out", str(out), "--add", "--processes", "1"])
    assert r.exit_code == 2, r.output
    assert r.output.startswith(f"error: --add: nothing to average with: {out} does not exist"), r.output
    assert not out.exists()
    monkeypatch.setenv(cal.CACHE_ENV, str(tmp_path / "cache"))  # no --out: this host's cached profile, none yet
    r = CliRunner().invoke(app, ["calibrate", "--add", "--processes", "1"])
    assert r.exit_code == 2 and "error: --add: nothing to average with: " in r.output, r.output
    with pytest.raises(cal.ConfigError, match=r"^add=True: nothing to average with"):
        cal.calibrate((1,), out, add=True)


def test_a_peer_dead_during_calibration_is_named_with_the_collective_it_left(monkeypatch):
    """The calibration's agreements (rounds, barriers, slowest spans) over the world: a peer gone at any of them
    is said in plait's words (which collective, over which ranks, whom it lost), not in Gloo's."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from plait.calibrate import collectives, pipeline_block, run, tp_block
    from plait.errors import CommError

    def failing_at(n: int):
        """A collective that works (its tensor becomes ones) ``n`` times, then fails as a closed peer's does."""
        calls = []

        def op(tensor=None, *args, **kwargs):
            calls.append(1)
            if len(calls) > n:
                raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:26505. "
                                   "GLHF!")
            if isinstance(tensor, torch.Tensor):
                tensor.fill_(1)
        return op

    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)  # beyond the sections' processes below: no work
    cpu, world = torch.device("cpu"), object()
    for call, said in [
        (lambda: run._probe(world, cpu), ["barrier before probing the host's speed",
                                          "barrier after probing the host's speed"]),
        (lambda: run._together(SimpleNamespace(calls={"mm": lambda: None}), cpu, world, 1),
         ["barrier before a kernel timed shared", "all-reduce of a shared kernel's span"]),
        (lambda: collectives.measure("all_reduce", 1024, [], 1, world, cpu),
         ["broadcast of a collective's repetitions", "barrier before a timed collective",
          "all-reduce of a timed collective's slowest time"]),
        (lambda: tp_block.measure((8, 8), 1, 1, False, [], world, cpu),  # one round (the broadcast's)
         ["broadcast of a TP layer's rounds"] + ["barrier before a timed TP layer"] * 2 + [
          "all-reduce of a TP layer's times"]),
        (lambda: pipeline_block.measure(1, world, cpu, budget=1e-9),  # its fewest rounds: the first fails
         ["all-reduce of the pipeline's warm-up time", "barrier before a timed pipeline",
          "all-reduce of a timed pipeline's span"]),
    ]:
        for n, what in enumerate(said):
            op = failing_at(n)  # the n-th collective of the call fails
            for name in ("barrier", "broadcast", "all_reduce"):
                monkeypatch.setattr(dist, name, op)
            with pytest.raises(CommError) as info:
                call()
            assert str(info.value) == (f"calibration's {what} over global ranks 0,1 failed (did global rank 0 die?): "
                                       "Connection closed by peer [127.0.0.1]:26505")


def test_the_profile_s_table_is_whole_in_80_columns(tmp_path):
    """plait calibrate's table of what it measured was cut in an 80-column terminal or a log ('proce…', 'GFLOP…',
    'all-r…' in its headers): every header and figure is whole now, in lines of at most 80 characters."""
    import io

    from rich.console import Console

    from plait.cli.calibrate import _summary

    profile = synthetic_profile(block=True)
    console = Console(file=io.StringIO(), width=80)
    _summary(console, profile, tmp_path / "host.toml")
    text = console.file.getvalue()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
    head = " ".join(text.split("─")[0].split())
    for word in ("procs", "threads", "GEMM", "GFLOP/s", "alone", "shared", "attention", "element-", "wise", "GB/s",
                 "kernel", "µs", "all-", "reduce", "1 MB ms", "TP wait"):
        assert word in head, (word, head)
    rows = [line.split() for line in text.splitlines() if line.split() and line.split()[0] in ("1", "2", "4", "8")]
    assert [r[0] for r in rows] == ["1", "2", "4", "8"] and all(r[-1].startswith("(tp") for r in rows[1:]), text


def test_calibrate_off_a_terminal_prints_a_line_a_phase(tmp_path, monkeypatch):
    """Piped (a CI log, `| tee`), the progress bar shows nothing and a calibration was minutes of silence; off a
    terminal it now prints on standard error a line as each phase (its figures' names, numbers aside) begins:
    the figures measured of the total, the seconds since the start, the latest figure."""
    import plait.calibrate as cal
    from plait.calibrate.run import total_steps

    ticks = ["starting", "matmul 64x64x64", "matmul 128x128x128", "attention s=128 d=64", "attention s=256 d=64",
             "all_reduce over 2 of 2 processes", "all_gather over 2 of 2 processes"]

    def measured(counts, progress):
        for done, what in enumerate(ticks):
            progress(done, what)
        return synthetic_profile(counts=(1, 2), block=True)

    monkeypatch.setattr(cal, "_measure_once", measured)
    r = CliRunner().invoke(app, ["calibrate", "--out", str(tmp_path / "host.toml"), "--processes", "1",
                                 "--processes", "2"])
    assert r.exit_code == 0, r.output
    total = total_steps([1, 2])
    lines = [x for x in r.stderr.splitlines() if x.startswith("plait calibrate: ")]
    shown = [(int(x.split()[2]), x.split(": ", 2)[2]) for x in lines]
    assert shown == [(0, "starting"), (1, "matmul 64x64x64"), (3, "attention s=128 d=64"),
                     (5, "all_reduce over 2 of 2 processes"), (6, "all_gather over 2 of 2 processes")], lines
    assert all(f" of {total} measured, " in x for x in lines), lines
