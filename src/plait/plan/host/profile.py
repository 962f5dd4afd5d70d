"""A calibrated host (``plait calibrate``): measured kernel speeds and collective times, read and written as TOML.

A profile has one section per process count ``P``: what *one* process gets when ``P`` processes of plait
run on this host at once, each with the thread count ``plait train`` gives it. Speeds are measured twice:
``alone`` (the other processes wait) and ``shared`` (all ``P`` compute at once), because processes that
outnumber the cores share them; a shared speed is read as the speed alone over its kind's median slow-down
(``Rate.slowdown``: one size's shared window is too noisy to stand alone). Collectives are measured with
every group of a size busy at once (as the TP groups of a run are), as (bytes, seconds) points, and a
tensor-parallel layer shows what each collective of a run waits beyond that (``TPBlock``). Pure Python:
``plait.calibrate`` measures (torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from plait.errors import ConfigError
from plait.plan.host.figures import (
    BLOCK,
    KERNELS,
    SECONDS_KINDS,
    Curve,
    Rate,
    TPBlock,
)

FORMAT = 5
HOST_KEYS = ("hostname", "cpu", "cores", "memory_bytes", "torch", "backend", "device")  # what changes speeds
# format 1: no decoder-layer timings nor optimizer step (the kernel mix only); format 2: the decoder layers'
# forward share is the whole layer's without autograd (read as the kernel mix's, see ``_section``); format 3:
# no whole-layer seconds (``LAYER``: a layer is costed from its kernels' figures alone); format 4: no layer
# with its attention core recomputed (``SELECTIVE``: selective recomputation costed as the core's forward)
READABLE_FORMATS = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class Section:
    """What one of ``processes`` processes (``threads`` threads each) gets on this host.

    ``rates``: matmul (FLOP/s; size = a linear layer's forward FLOPs), attention (causal, FLOP/s counted
    as 4·s²·d per head and sequence, non-causal, forward and backward together; size = s·d) and
    elementwise (forward + backward time per forward byte moved, as ``plan.host.census`` counts bytes; size =
    bytes per kernel). Optional ``block`` (profiles of format >= 2): seconds of a real decoder layer's forward
    and backward beyond its GEMMs and attention, one per ``plan.host.shapes.CALIBRATION_BLOCKS`` entry (size = its
    hidden-state elements; forward share: the share of the larger block's seconds spent in its forward,
    autograd recording; a format-2 profile's is read as the kernel mix's). Optional ``layer`` (format >= 4):
    the same layers' whole forward + backward seconds, ``alone`` and ``shared`` each as measured (forward
    share: the larger layer's); ``plan.host.compute.in_step`` sets them beside what the kernel figures make of
    the same layers.
    ``op_overhead_s``: the fixed cost of one small kernel forward plus its backward (dispatch, autograd).
    ``optimizer_s_per_param``: plait's optimizer step (global norm, clip, AdamW) per fp32 parameter of one
    process, the others waiting (0: not measured, format 1), and ``optimizer_s_per_tensor`` its fixed cost
    per parameter tensor (0: not measured; the per-parameter figure then holds both, as timed on a set of
    parameters that fit the cache).
    ``tp_blocks``: a tensor-parallel decoder layer timed over each group size (optional; see ``TPBlock``).
    ``pipeline_s`` and ``pipeline_twin_s`` (where the processes outnumber the cores; else, or in an older
    profile, 0): a step of two-stage pipelines of the larger calibration layer over the section's processes
    and the same work without hand-offs (``plait.calibrate.pipeline_block``; ``plan.host.sharing.handoff``).
    """

    processes: int
    threads: int
    rates: dict[str, Rate]
    op_overhead_s: float
    memory_bandwidth: float  # bytes/s of one process streaming large arrays, all processes at once
    collectives: dict[tuple[str, int], Curve] = field(default_factory=dict)
    optimizer_s_per_param: float = 0.0
    tp_blocks: tuple[TPBlock, ...] = ()
    optimizer_s_per_tensor: float = 0.0
    pipeline_s: float = 0.0
    pipeline_twin_s: float = 0.0

    def at_speed(self, kernels: float, collectives: float, tp: float) -> Section:
        """This section as if the host had run each phase of its measuring at ``x`` times the speed it had:
        the kernel figures (alone and shared, timed in pairs, the memory bandwidth and the optimizer step) by
        ``kernels``, the collective curves by ``collectives``, the TP layers and the pipeline (timed after
        them) by ``tp`` (rates times ``x``, seconds over ``x``). ``plait calibrate`` brings every phase to the
        host's mean speed over the whole calibration this way (``plait.calibrate.run``)."""
        def rate(kind: str, r: Rate) -> Rate:
            power = -1 if kind in SECONDS_KINDS else 1
            return Rate(r.sizes, tuple(v * kernels ** power for v in r.alone),
                        tuple(v * kernels ** power for v in r.shared), r.forward_share)

        return Section(self.processes, self.threads, {kind: rate(kind, r) for kind, r in self.rates.items()},
                       self.op_overhead_s / kernels, self.memory_bandwidth * kernels,
                       {key: Curve(c.bytes, tuple(t / collectives for t in c.seconds))
                        for key, c in self.collectives.items()},
                       self.optimizer_s_per_param / kernels,
                       tuple(TPBlock(b.shape, b.group, b.sequence_parallel, b.seconds / tp, b.twin_s / tp)
                             for b in self.tp_blocks),
                       self.optimizer_s_per_tensor / kernels, self.pipeline_s / tp, self.pipeline_twin_s / tp)

    @staticmethod
    def average(sections: list[tuple[Section, int]]) -> Section:
        """The weighted mean of one process count's sections (``HostProfile.average``): times averaged,
        rates by their harmonic mean; collectives and TP layers that only some sections have are averaged
        over those."""
        first = sections[0][0]
        if any((s.processes, s.threads) != (first.processes, first.threads) for s, _ in sections):
            raise ConfigError(f"profile: sections of {first.processes} processes ran different thread counts")
        rates = {}
        for kind in sorted({k for s, _ in sections for k in s.rates}):
            same = [(s.rates[kind], w) for s, w in sections if kind in s.rates]
            r = same[0][0]
            if any(x.sizes != r.sizes for x, _ in same):
                raise ConfigError(f"profile: {kind} was measured at different sizes; average calibrations "
                                  "made the same way")
            mean = _mean if kind in SECONDS_KINDS else _harmonic
            rates[kind] = Rate(r.sizes, tuple(mean([(x.alone[i], w) for x, w in same]) for i in range(len(r.sizes))),
                               tuple(mean([(x.shared[i], w) for x, w in same]) for i in range(len(r.sizes))),
                               _mean([(x.forward_share, w) for x, w in same]))
        if len({s.optimizer_s_per_tensor > 0 for s, _ in sections}) > 1:
            raise ConfigError("profile: the optimizer step was timed per tensor in some calibrations and not in "
                              "others; average calibrations made the same way")
        curves = {}
        for key in sorted({k for s, _ in sections for k in s.collectives}):
            have = [(s.collectives[key], w) for s, w in sections if key in s.collectives]
            if any(c.bytes != have[0][0].bytes for c, _ in have):
                raise ConfigError(f"profile: {key[0]} over {key[1]} was measured at different sizes; average "
                                  "calibrations made the same way")
            curves[key] = Curve(have[0][0].bytes, tuple(_mean([(c.seconds[i], w) for c, w in have])
                                                        for i in range(len(have[0][0].bytes))))
        blocks = []
        for b in {(b.shape, b.group, b.sequence_parallel): b for s, _ in sections for b in s.tp_blocks}.values():
            timed = [(x, w) for s, w in sections for x in s.tp_blocks
                     if (x.shape, x.group, x.sequence_parallel) == (b.shape, b.group, b.sequence_parallel)]
            blocks.append(TPBlock(b.shape, b.group, b.sequence_parallel, _mean([(x.seconds, w) for x, w in timed]),
                                  _mean([(x.twin_s, w) for x, w in timed])))
        piped = [(s, w) for s, w in sections if s.pipeline_s > 0 and s.pipeline_twin_s > 0]
        return Section(first.processes, first.threads, rates,
                       _mean([(s.op_overhead_s, w) for s, w in sections]),
                       _harmonic([(s.memory_bandwidth, w) for s, w in sections]), curves,
                       _mean([(s.optimizer_s_per_param, w) for s, w in sections]),
                       tuple(sorted(blocks, key=lambda b: (b.shape, b.group, b.sequence_parallel))),
                       _mean([(s.optimizer_s_per_tensor, w) for s, w in sections]),
                       _mean([(s.pipeline_s, w) for s, w in piped]) if piped else 0.0,
                       _mean([(s.pipeline_twin_s, w) for s, w in piped]) if piped else 0.0)

    def tp_block(self, shape: tuple[int, ...], group: int, sequence_parallel: bool) -> TPBlock | None:
        """The timed layer of ``shape`` over ``group`` ranks (sequence parallel or not), if measured."""
        return next((b for b in self.tp_blocks if b.shape == tuple(shape) and b.group == group
                     and b.sequence_parallel == sequence_parallel), None)

    def collective(self, op: str, group: int, nbytes: float) -> float:
        """Seconds of ``op`` over ``group`` ranks moving ``nbytes`` per rank (the input tensor's size)."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        sizes = sorted(g for o, g in self.collectives if o == op)
        if not sizes:
            raise ConfigError(f"profile: {op} was not measured; run `plait calibrate` again")
        g = next((s for s in sizes if s >= group), sizes[-1])  # the nearest measured group at least as big
        return self.collectives[(op, g)](nbytes)


@dataclass(frozen=True)
class HostProfile:
    """Facts about the host (``host``: hostname, cpu, cores, memory_bytes, torch, backend, device) and the
    measured ``sections`` by process count."""

    host: dict[str, Any]
    sections: dict[int, Section]

    @property
    def name(self) -> str:
        return str(self.host.get("hostname", "host"))

    @property
    def cores(self) -> int:
        return int(self.host.get("cores", 1))

    def section(self, processes: int) -> Section:
        if processes not in self.sections:
            have = ", ".join(str(p) for p in sorted(self.sections)) or "none"
            raise ConfigError(f"processes: the profile of {self.name} measured {have} processes, not "
                              f"{processes}; run `plait calibrate --processes {processes}`")
        return self.sections[processes]

    @property
    def calibrations(self) -> int:
        """How many calibrations this profile is the mean of (``average``); 1 for one."""
        return int(self.host.get("calibrations", 1))

    @classmethod
    def average(cls, profiles: list[HostProfile]) -> HostProfile:
        """The mean of calibrations of one host taken at different times, each weighted by how many it
        already holds: every figure's *time* is averaged (rates by their harmonic mean), so the profile
        predicts a run that meets the host at any of those moments. A host whose neighbours speed it up
        and slow it down over minutes is predicted by its average, not by one minute of it.

        Only sections, collectives and TP layers measured the same way (same sizes) are averaged; one that
        some profiles lack is taken from those that have it."""
        if not profiles:
            raise ConfigError("profile: nothing to average")
        if len(profiles) == 1:
            return profiles[0]
        if len({tuple(str(p.host.get(k)) for k in HOST_KEYS) for p in profiles}) > 1:
            names = ", ".join(sorted({f"{p.name} ({p.host.get('cpu')}, torch {p.host.get('torch')})"
                                      for p in profiles}))
            raise ConfigError(f"--cluster: these profiles are of different hosts or software ({names}); "
                              "average only calibrations of one host")
        weights = [p.calibrations for p in profiles]
        sections = {}
        for n in sorted({n for p in profiles for n in p.sections}):
            have = [(p.sections[n], w) for p, w in zip(profiles, weights, strict=True) if n in p.sections]
            sections[n] = Section.average(have)
        host = {**profiles[-1].host, "calibrations": sum(weights)}
        speeds = [(float(p.host["speed_flops"]), w) for p, w in zip(profiles, weights, strict=True)
                  if p.host.get("speed_flops")]
        if speeds:
            probes = [float(x) for p in profiles for x in p.host.get("speed_probes", [])]
            host["speed_flops"] = _harmonic(speeds)
            host["speed_probes"] = probes
            host["speed_moved"] = (max(probes) - min(probes)) / host["speed_flops"] if probes else 0.0
        else:
            for k in ("speed_flops", "speed_probes", "speed_moved"):
                host.pop(k, None)
        return cls(host, sections)

    def merged(self, other: HostProfile) -> HostProfile:
        """This profile with ``other``'s sections added (``other`` wins where both measured)."""
        return HostProfile({**self.host, **other.host}, {**self.sections, **other.sections})

    # ------------------------------------------------------------------------------------------ TOML
    def to_toml(self) -> str:
        lines = [f"# plait calibrate: measured speeds of {self.name}", f"format = {FORMAT}", "", "[host]"]
        lines += [f"{k} = {_value(v)}" for k, v in sorted(self.host.items())]
        for p in sorted(self.sections):
            s = self.sections[p]
            lines += ["", "[[section]]", f"processes = {s.processes}", f"threads = {s.threads}",
                      f"op_overhead_s = {_value(s.op_overhead_s)}",
                      f"memory_bandwidth = {_value(s.memory_bandwidth)}",
                      f"optimizer_s_per_param = {_value(s.optimizer_s_per_param)}",
                      f"optimizer_s_per_tensor = {_value(s.optimizer_s_per_tensor)}",
                      f"pipeline_s = {_value(s.pipeline_s)}", f"pipeline_twin_s = {_value(s.pipeline_twin_s)}"]
            for kind in sorted(s.rates):
                r = s.rates[kind]
                lines += ["", "[[section.rate]]", f'kind = "{kind}"', f"sizes = {_value(list(r.sizes))}",
                          f"alone = {_value(list(r.alone))}", f"shared = {_value(list(r.shared))}",
                          f"forward_share = {_value(r.forward_share)}"]
            for (op, group), c in sorted(s.collectives.items()):
                lines += ["", "[[section.collective]]", f'op = "{op}"', f"group = {group}",
                          f"bytes = {_value(list(c.bytes))}", f"seconds = {_value(list(c.seconds))}"]
            for b in s.tp_blocks:
                lines += ["", "[[section.tp_block]]", f"shape = {_value(list(b.shape))}", f"group = {b.group}",
                          f"sequence_parallel = {_value(b.sequence_parallel)}", f"seconds = {_value(b.seconds)}",
                          f"twin_s = {_value(b.twin_s)}"]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml(cls, text: str, source: str = "profile") -> HostProfile:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"--cluster {source}: not valid TOML ({exc})") from None
        if raw.get("format") not in READABLE_FORMATS or "host" not in raw:
            *older, last = map(str, READABLE_FORMATS)
            raise ConfigError(f"--cluster {source}: not a `plait calibrate` profile (format {', '.join(older)} or "
                              f"{last}); make one with `plait calibrate`")
        try:
            sections = {int(s["processes"]): _section(s, raw["format"]) for s in raw.get("section", [])}
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"--cluster {source}: malformed section ({exc})") from None
        return cls(dict(raw["host"]), sections)

    @classmethod
    def load(cls, path: str | Path) -> HostProfile:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--cluster {p}: no such file (make one with `plait calibrate --out {p}`)")
        return cls.from_toml(p.read_text(), str(p))

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(self.to_toml())
        tmp.replace(p)  # atomic: a reader never sees half a profile
        return p


def _section(s: dict, fmt: int) -> Section:
    rates = {r["kind"]: Rate(tuple(map(float, r["sizes"])), tuple(map(float, r["alone"])),
                             tuple(map(float, r["shared"])), float(r["forward_share"])) for r in s.get("rate", [])}
    missing = set(KERNELS) - set(rates)
    if missing:
        raise KeyError(f"rates {sorted(missing)}")
    if fmt < 3 and BLOCK in rates:  # its share was the whole layer's without autograd; the mix's split it then
        rates[BLOCK] = replace(rates[BLOCK], forward_share=rates["elementwise"].forward_share)
    curves = {(c["op"], int(c["group"])): Curve(tuple(map(float, c["bytes"])), tuple(map(float, c["seconds"])))
              for c in s.get("collective", [])}
    blocks = tuple(TPBlock(tuple(map(int, b["shape"])), int(b["group"]), bool(b["sequence_parallel"]),
                           float(b["seconds"]), float(b["twin_s"])) for b in s.get("tp_block", []))
    return Section(int(s["processes"]), int(s["threads"]), rates, float(s["op_overhead_s"]),
                   float(s["memory_bandwidth"]), curves, float(s.get("optimizer_s_per_param", 0.0)), blocks,
                   float(s.get("optimizer_s_per_tensor", 0.0)), float(s.get("pipeline_s", 0.0)),
                   float(s.get("pipeline_twin_s", 0.0)))


def _mean(values: list[tuple[float, int]]) -> float:
    """Weighted arithmetic mean of (value, weight) pairs (times)."""
    return sum(v * w for v, w in values) / sum(w for _, w in values)


def _harmonic(values: list[tuple[float, int]]) -> float:
    """Weighted harmonic mean of (rate, weight) pairs: the rate of the mean time per unit of work."""
    if any(v <= 0 for v, _ in values):
        return _mean(values)
    return sum(w for _, w in values) / sum(w / v for v, w in values)


def _value(v: Any) -> str:
    """A TOML literal for the simple values a profile holds."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v) if isinstance(v, int) or math.isfinite(v) else "nan"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    text = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'
