"""``bench/gpu_check.py``'s memory check: plait's bytes measured in the train section (``pm.memory_report()`` and
the device allocator's peak), set beside ``plait train --dry-run``'s predicted bytes in the predict section."""

from __future__ import annotations

from collections.abc import Callable

#: the kinds ``pm.memory_report()`` measures and the dry run predicts, and the short name each ratio takes
KINDS = {"params": "params", "grads": "grads", "optimizer": "optimizer", "activations_peak": "activations"}


def measure_memory(pm, forward_backward: Callable[[], None], optimizer_step: Callable[[], None], device) -> dict:
    """Bytes of plait's run on this rank, measured on two steps taken before anything else is on the device.

    The first step measures what autograd saves (``train_step``'s default, as ``plait train``'s first step
    does); ``pm.memory_report()`` after it (optimizer state created) gives params, grads, optimizer and
    activations_peak. Over the second step the device allocator (``plait.devices.peak_allocated``; None on a CPU)
    gives ``device_at_rest``, the bytes allocated as it starts (the model states and whatever else stays, e.g.
    the BLAS library's workspaces), and its peak in each part: ``device_peak_forward_backward`` (zero_grad and
    ``train_step``), ``device_peak_optimizer`` (the optimizer's step: clipping, AdamW); ``device_peak`` the
    larger, the whole step's."""
    from plait.devices import peak_allocated, reset_peak_memory

    forward_backward()
    optimizer_step()
    report = pm.memory_report()
    reset_peak_memory(device)
    at_rest = peak_allocated(device)  # the peak of a window just started: what is allocated now
    forward_backward()
    fb = peak_allocated(device)
    reset_peak_memory(device)
    optimizer_step()
    opt = peak_allocated(device)
    return {**{kind: report[kind] for kind in KINDS}, "device_peak": None if fb is None else max(fb, opt or 0),
            "device_at_rest": at_rest, "device_peak_forward_backward": fb, "device_peak_optimizer": opt}


def memory_beside(predicted: dict, measured: dict | None) -> dict:
    """The dry run's predicted bytes of one pipeline rank (a row of ``plait.cli.predict.memory_rows``) beside
    ``measure_memory``'s: per kind predicted, measured and measured/predicted (``memory``), the ratios also as
    ``<kind>_measured_over_predicted``; the predicted peak of the step (``total``: the model states, the
    activations at their peak and what the step holds beside them, ``weight_copies`` and ``loss_backward``: what
    the planner checks against the device's memory) beside the allocator's peak where there is one, and the
    predicted model states beside what the allocator holds as the step starts."""
    measured = measured or {}
    total = predicted["total"]
    states = predicted["params"] + predicted["grads"] + predicted["optimizer"]
    rows, out = {}, {}
    for kind, short in KINDS.items():
        p, m = predicted[kind], measured.get(kind)
        ratio = m / p if m is not None and p else None
        rows[kind] = {"predicted": p, "measured": m, "measured_over_predicted": ratio}
        out[f"{short}_measured_over_predicted"] = ratio
    peak, rest = measured.get("device_peak"), measured.get("device_at_rest")
    return {"memory": rows, **out, "predicted_weight_copies_bytes": predicted["weight_copies"],
            "predicted_loss_backward_bytes": predicted["loss_backward"], "predicted_total_bytes": total,
            "device_peak_bytes": peak,
            "device_peak_over_predicted_total": peak / total if peak is not None and total else None,
            "device_peak_forward_backward_bytes": measured.get("device_peak_forward_backward"),
            "device_peak_optimizer_bytes": measured.get("device_peak_optimizer"),
            "device_at_rest_bytes": rest,
            "device_at_rest_over_predicted_states": rest / states if rest is not None and states else None}
