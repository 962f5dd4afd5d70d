"""``bench/gpu_check.py``'s memory check: plait's bytes measured in the train section (``pm.memory_report()`` and
the device allocator's peak), set beside ``plait train --dry-run``'s predicted bytes in the predict section."""

from __future__ import annotations

from collections.abc import Callable

#: the kinds ``pm.memory_report()`` measures and the dry run predicts, and the short name each ratio takes
KINDS = {"params": "params", "grads": "grads", "optimizer": "optimizer", "activations_peak": "activations"}


def measure_memory(pm, step: Callable[[], None], device) -> dict:
    """Bytes of plait's run on this rank, measured on two steps taken before anything else is on the device.

    The first step measures what autograd saves (``train_step``'s default, as ``plait train``'s first step
    does); ``pm.memory_report()`` after it (optimizer state created) gives params, grads, optimizer and
    activations_peak. ``device_peak``: the allocator's peak over the whole second step (forward, backward,
    optimizer; ``plait.devices.peak_allocated``), None on a CPU."""
    from plait.devices import peak_allocated, reset_peak_memory

    step()
    report = pm.memory_report()
    reset_peak_memory(device)
    step()
    return {**{kind: report[kind] for kind in KINDS}, "device_peak": peak_allocated(device)}


def memory_beside(predicted: dict, measured: dict | None) -> dict:
    """The dry run's predicted bytes of one pipeline rank (a row of ``plait.cli.predict.memory_rows``) beside
    ``measure_memory``'s: per kind predicted, measured and measured/predicted (``memory``), the ratios also as
    ``<kind>_measured_over_predicted``; the predicted total at the activation peak (what the planner checks
    against the device's memory) beside the allocator's peak where there is one."""
    measured = measured or {}
    total = (predicted["params"] + predicted["grads_at_peak"] + predicted["optimizer"]
             + predicted["activations_peak"] + predicted["recompute_working"]
             + predicted.get("params_gathered_peak", 0))
    rows, out = {}, {}
    for kind, short in KINDS.items():
        p, m = predicted[kind], measured.get(kind)
        ratio = m / p if m is not None and p else None
        rows[kind] = {"predicted": p, "measured": m, "measured_over_predicted": ratio}
        out[f"{short}_measured_over_predicted"] = ratio
    peak = measured.get("device_peak")
    return {"memory": rows, **out, "predicted_total_bytes": total, "device_peak_bytes": peak,
            "device_peak_over_predicted_total": peak / total if peak is not None and total else None}
