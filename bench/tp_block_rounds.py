"""Benchmark: how steady the calibration's tensor-parallel figure is, and how it moves with the round length.

``plait calibrate`` times a tensor-parallel decoder layer against its compute twin (the same kernels, no
collective) in alternating rounds, every TP group of the section at once (``plait.calibrate.tp_block``).
What the layer takes beyond its twin, per collective, is what the planner charges each TP collective of a
run (``plan.timing.tp_wait`` adds it to the collective's back-to-back time). Where processes outnumber the
cores that figure is a difference of two noisy times, and it depends on how the timing is done.

This repeats ``tp_block.measure`` in one world of ``--processes`` processes (groups of ``--group``), for
each calibration shape (and ``small``'s own layer, 2x128 tokens of width 256), with and without sequence
parallelism, at several round lengths (``--calls``: calls of each part between the barriers; the
calibration uses ``tp_block.ROUND_CALLS``), each for the calibration's budget per figure. Printed: per
collective, (layer - twin) in ms, mean and standard deviation over ``--repeats``, and the same as JSON.
The round lengths alternate their order from one repeat to the next.

``--quick``: one shape, two repeats, a short budget (a smoke run). Nothing else should run meanwhile. The
default takes about 3 minutes on a two-core host.
"""

from __future__ import annotations

import argparse
import json
import statistics

# `small`'s layer (batch, sequence, hidden, heads, KV heads) at the micro-batch plait train gives the tp2 dp2
# layouts of bench/plan_vs_run.py (2 x 128 tokens), timed beside the calibration's two shapes
SMALL = (2, 128, 256, 8, 4)


def collectives_per_layer(sequence_parallel: bool) -> int:
    """TP collectives of one decoder layer's forward + backward: per region (attention, MLP) one all-reduce
    each way; under sequence parallelism an all-gather and a reduce-scatter each way."""
    return 8 if sequence_parallel else 4


def work(shapes: list[tuple[int, ...]], calls: list[int], repeats: int, budget: float, group: int) -> dict:
    import torch
    import torch.distributed as dist

    from plait.calibrate import tp_block

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(i, i + group))) for i in range(0, world, group)]
    device = torch.device("cpu")
    out: dict = {}
    for shape in shapes:
        for sp in (False, True):
            for r in range(repeats):
                for c in (calls if r % 2 == 0 else calls[::-1]):
                    layer, twin = tp_block.measure(shape, world, group, sp, groups, dist.group.WORLD, device,
                                                   budget, calls=c)
                    out.setdefault((tuple(shape), sp, c), []).append((layer, twin))
    dist.destroy_process_group()
    return out if rank == 0 else {}


def main() -> None:
    from plait.calibrate import tp_block
    from plait.distributed.launch import run_world
    from plait.plan.host import shapes

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--processes", type=int, default=4, help="processes of the world (default 4)")
    parser.add_argument("--group", type=int, default=2, help="TP group size (default 2)")
    parser.add_argument("--calls", default=f"{tp_block.ROUND_CALLS},8,16",
                        help="comma-separated calls of each part per round")
    parser.add_argument("--repeats", type=int, default=4, help="repeats of every figure (default 4)")
    parser.add_argument("--budget", type=float, default=tp_block.BUDGET_S,
                        help="seconds per figure (default: the calibration's)")
    parser.add_argument("--quick", action="store_true", help="one shape, two repeats, 0.3 s per figure")
    args = parser.parse_args()
    calls = [int(c) for c in args.calls.split(",")]
    shapes = [*shapes.TP_CALIBRATION_BLOCKS, SMALL]
    if args.quick:
        shapes, args.repeats, args.budget = [shapes.TP_CALIBRATION_BLOCKS[0]], 2, 0.3
    raw = run_world(work, args.processes, shapes, calls, args.repeats, args.budget, args.group, timeout_s=1800)[0]
    rows = []
    print(f"{args.processes} processes, TP groups of {args.group}, {args.budget} s per figure, "
          f"{args.repeats} repeats; per collective, layer - twin (ms): mean ± standard deviation")
    print(f"{'layer':<16}{'SP':<6}" + "".join(f"{f'{c} calls':>16}" for c in calls))
    for shape in shapes:
        for sp in (False, True):
            cells = []
            for c in calls:
                pairs = raw[(tuple(shape), sp, c)]
                per = [(a - b) * 1e3 / collectives_per_layer(sp) for a, b in pairs]
                sd = statistics.stdev(per) if len(per) > 1 else float("nan")
                cells.append(f"{statistics.mean(per):.2f} ± {sd:.2f}")
                rows.append({"shape": list(shape), "sequence_parallel": sp, "calls": c, "per_collective_ms": per,
                             "layer_s": [a for a, _ in pairs], "twin_s": [b for _, b in pairs]})
            print(f"{f'{shape[0]}x{shape[1]} h{shape[2]}':<16}{('yes' if sp else 'no'):<6}"
                  + "".join(f"{x:>16}" for x in cells))
    print(json.dumps({"processes": args.processes, "group": args.group, "budget_s": args.budget,
                      "round_calls_calibrated": tp_block.ROUND_CALLS, "rows": rows}))


if __name__ == "__main__":
    main()
