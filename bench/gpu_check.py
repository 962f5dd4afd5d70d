"""One-device check of plait's GPU path: tests on the device, training speed beside transformers', the planner's
prediction beside the measured step, generation and serving speed. Writes ``gpu_check.json`` and a Markdown
table to ``--out``.

    python bench/gpu_check.py --device cuda --out gpu-check          # make gpu-check: ~4 min on one H200
    python bench/gpu_check.py --device cpu --quick --out gpu-check   # the same sections on a CPU, small sizes

Sections (each runs on its own: one that fails records ``{"error": ...}`` and the rest still run; the JSON is
rewritten after each, so a run cut short keeps the sections it finished):
  device    name, memory, torch and CUDA versions; on a GPU ``launch_us``, what one tiny kernel costs the host
  tests     ``pytest tests/test_device_path.py tests/test_device_guards.py --device DEV``: passed / failed
            (``--test-files`` names others)
  gemm      ``torch.mm`` speeds on the shapes of the published runs' GEMMs and a grid, beside the planner's cost of
            each GEMM on this GPU (``gpu_check_gemm.py``; every timing in ``gemm.json``)
  elementwise  the kinds of element-wise kernel plait's eager step launches at the train section's shapes: GB/s
            of each, share of the catalogue's bandwidth (``gpu_check_elementwise.py``)
  attention causal SDPA forward and forward + backward by sequence length (512 ... 16k) and head dimension (64,
            128) under each fused backend (flash, cuDNN, efficient), the backend SDPA picks, and the planner's speed
            of each shape beside (``gpu_check_attention.py``; every timing in ``attention.json``)
  train     one process: plait (``parallelize`` + ``ParallelOptimizer``, bf16 over fp32 masters on a GPU) and
            transformers' ``LlamaForCausalLM`` (fp32 weights under bf16 autocast), both with torch's fused AdamW, on
            the same config, batch and device, stepped in turn: tokens/s of each, their ratio, plait's MFU (6N +
            12·L·d·S FLOPs a token, PaLM's count, over the device's dense bf16 peak); on a GPU one step of each
            under torch.profiler (``profile.txt``: the busiest kernels and host calls)
  predict   ``plait train --dry-run`` of the same run: the planner's predicted step beside the step measured in
            ``train``, its predicted bytes by kind beside ``pm.memory_report()``'s and its total beside the
            allocator's peak (``gpu_check_memory.py``); on a GPU from the planner's GPU model (``plait.plan.gpu``,
            fitted on published runs), on a CPU from ``plait calibrate --processes 1`` run first (with
            ``--quick``, from this host's cached profile, as ``plait train`` predicts by default)
  generate  ``plait.generate`` tokens/s at batch 1 and 32 (greedy, KV cache), beside transformers' ``generate``
            (``gpu_check_generate.py``)
  serve     ``plait serve`` on the device (bfloat16 on a GPU), 32 concurrent completions: output tokens/s
            (``gpu_check_serve.py``)
  serve_step  the serving runner's decode step alone at 32 rows beside batched ``plait.generate``'s step, each
            the first time its shapes come and again, the runner with its keys' length rounded and exact; three
            of its steps profiled (``serve_profile.txt``)
On a CPU ``mfu`` is null (no dense-peak figure to divide by); every other key is filled.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from gpu_check_attention import attention_section
from gpu_check_elementwise import elementwise_section
from gpu_check_gemm import gemm_section
from gpu_check_generate import generate_section
from gpu_check_memory import measure_memory, memory_beside
from gpu_check_serve import serve_section, serve_step_section

ROOT = Path(__file__).resolve().parents[1]
GPU_MODEL = dict(vocab_size=32000, dim=1536, n_layers=20, n_heads=12, n_kv_heads=4, ffn_dim=4096, max_seq_len=2048)
CPU_MODEL = dict(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=128)


def _sizes(quick: bool, cuda: bool) -> dict:
    model = GPU_MODEL if cuda else CPU_MODEL
    return {"model": model, "batch": 4 if cuda else 2, "seq": model["max_seq_len"], "warm": 3 if cuda else 1,
            "steps": 10 if cuda and not quick else 3, "new_tokens": 64 if cuda else 16, "prompt": 128 if cuda else 16}


#: the one-process world's variables (``_world``): a child command that inherited them would join that world, or
#: bind its store's port, instead of starting its own
WORLD_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _env() -> dict:
    """The environment of a child command: this tree's sources first, none of this process's world variables."""
    env = {k: v for k, v in os.environ.items() if k not in WORLD_VARS}
    env["PYTHONPATH"] = f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _plait(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plait.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=ROOT)


# ------------------------------------------------------------------------------------------------ sections
def device_section(device) -> dict:
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"name": props.name, "memory_bytes": props.total_memory, "torch": torch.__version__,
                "cuda": torch.version.cuda, "multiprocessors": props.multi_processor_count,
                "launch_us": _launch_us(device)}
    return {"name": platform.processor() or platform.machine(), "memory_bytes": os.sysconf("SC_PAGE_SIZE")
            * os.sysconf("SC_PHYS_PAGES"), "torch": torch.__version__, "cuda": None, "cores": os.cpu_count()}


def _launch_us(device, n: int = 2000) -> float:
    """Microseconds a tiny kernel costs the host (launch included), over ``n`` back to back: what an eager step
    pays per kernel however small its work; host-bound decoding runs at about one such cost per kernel."""
    import torch

    from plait.devices import synchronize

    x = torch.zeros(8, device=device)
    for _ in range(50):
        x.add_(1)
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    synchronize(device)
    return (time.perf_counter() - t0) / n * 1e6


#: the test files the tests section runs unless ``--test-files`` names others
DEVICE_TESTS = ("tests/test_device_path.py", "tests/test_device_guards.py")


def tests_section(device, out: Path, files: list[str]) -> dict:
    xml = out / "tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, f"--device={device}",
           f"--junitxml={xml}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env(), cwd=ROOT)
    import xml.etree.ElementTree as ET

    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    n, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None
              or c.find("error") is not None]
    return {"passed": n - failures - errors - skipped, "failed": failures + errors, "skipped": skipped,
            "failed_names": failed, "exit_code": proc.returncode,
            "files": files}


def _world(device):
    """A one-process world on ``device``'s backend (Gloo on CPU, NCCL on CUDA) and its context."""
    import torch

    import plait
    from plait.distributed.launch import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK=str(device.index or 0))
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    return plait.init(1, 1, 1)


def _timed(step, device, n: int) -> list[float]:
    from plait.devices import synchronize

    times = []
    for _ in range(n):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def _profile(steps: dict, out: Path, device) -> None:
    """Each of ``steps`` once under torch.profiler: its busiest kernels (host operations on a CPU) and host calls,
    written to ``out``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with out.open("w") as f:
        for name, step in steps.items():
            with profile(activities=activities) as prof:
                step()
            for key in ("self_device_time_total" if cuda else "self_cpu_time_total", "cpu_time_total"):
                f.write(f"== {name}, by {key}\n{prof.key_averages().table(sort_by=key, row_limit=25)}\n")


def train_section(ctx, sizes: dict, folder: Path, out: Path) -> dict:
    """plait and transformers on the same Llama, batch and device, one step of each in turn."""
    import statistics

    import torch
    from transformers import LlamaForCausalLM

    import plait
    from plait.models import Llama, LlamaConfig
    from plait.optim import ParallelOptimizer
    from plait.plan.catalogue import gpu_of_device

    device, cuda = ctx.device, ctx.device.type == "cuda"
    cfg = LlamaConfig(**sizes["model"])
    torch.manual_seed(0)
    Llama(cfg).save_pretrained(folder)  # the same weights for both, and the folder predict/generate/serve use
    precision = "bf16" if cuda else "fp32"
    pm = plait.parallelize(Llama.from_pretrained(folder), ctx, microbatches=1, precision=precision)
    opt = ParallelOptimizer(pm, torch.optim.AdamW, lr=1e-4, precision=precision, clip=1.0, fused=True)
    b, s = sizes["batch"], sizes["seq"]
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0)).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def forward_backward() -> None:
        pm.zero_grad()
        pm.train_step(x, y)

    def plait_step() -> None:
        forward_backward()
        opt.step()

    memory = measure_memory(pm, forward_backward, opt.step, device)  # untimed, before transformers' model is here
    hf = LlamaForCausalLM.from_pretrained(folder, attn_implementation="sdpa", torch_dtype=torch.float32).to(device)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=True)

    def hf_step() -> None:  # the same S positions forward and backward (transformers shifts the labels itself)
        hf_opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = hf(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hf_opt.step()

    for _ in range(sizes["warm"]):
        plait_step()
        hf_step()
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(sizes["steps"]):  # in turn, so a change of clock or load hits both alike
        ours += _timed(plait_step, device, 1)
        theirs += _timed(hf_step, device, 1)
    step_s, hf_step_s = statistics.median(ours), statistics.median(theirs)
    if cuda:
        _profile({"plait": plait_step, "transformers": hf_step}, out / "profile.txt", device)
    n_params = sum(p.numel() for p in Llama.from_pretrained(folder).parameters())
    flops_per_token = 6 * n_params + 12 * cfg.n_layers * cfg.dim * s
    gpu = gpu_of_device(torch.cuda.get_device_name(device)) if cuda else None
    peak = gpu.peak_flops if gpu is not None else None  # the planner catalogue's dense bf16 peak
    tps, hf_tps = b * s / step_s, b * s / hf_step_s
    return {"params": n_params, "batch": b, "seq_len": s, "precision": precision, "steps_timed": sizes["steps"],
            "measured_step_s": step_s, "train_tokens_per_s": tps, "hf_step_s": hf_step_s,
            "hf_train_tokens_per_s": hf_tps, "ratio_vs_hf": tps / hf_tps,
            "mfu": flops_per_token * tps / peak if peak else None, "peak_flops": peak, "memory": memory}


def predict_section(sizes: dict, precision: str, folder: Path, out: Path, train: dict, cuda: bool,
                    quick: bool) -> dict:
    """``plait train --dry-run`` of the ``train`` section's run: the step and the bytes (rank 0's) ``plait train``
    predicts beside those measured (``gpu_check_memory``). On a GPU it predicts with the planner's GPU model of
    this device; on a CPU with a profile ``plait calibrate`` measures first, or with ``quick`` with this host's
    cached profile (``plait train``'s own default, made on first use)."""
    profile, metrics = out / "host.toml", out / "predict.jsonl"
    calibrate = not cuda and not quick
    t0 = time.perf_counter()
    if calibrate:
        cal = _plait("calibrate", "--processes", "1", "--out", str(profile), timeout=420)
        if cal.returncode:
            raise RuntimeError(f"plait calibrate exited {cal.returncode}: {cal.stderr[-2000:]}")
    calibrate_s = time.perf_counter() - t0
    metrics.unlink(missing_ok=True)
    run = _plait("train", "--dry-run", *(("--cluster", str(profile)) if calibrate else ()), "--model", str(folder),
                 "--tp", "1", "--pp", "1", "--nproc", "1", "--microbatches", "1", "--batch-size", str(sizes["batch"]),
                 "--seq-len", str(sizes["seq"]), "--precision", precision, "--metrics", str(metrics), timeout=300)
    if run.returncode:
        raise RuntimeError(f"plait train --dry-run exited {run.returncode}: {run.stderr[-2000:]}")
    row = json.loads(metrics.read_text().splitlines()[-1])
    predicted, measured_step_s = row["predicted_step_time_s"], train.get("measured_step_s")
    return {"calibrate_s": calibrate_s if calibrate else None, "predicted_on": row["predicted_on"],
            "predicted_step_s": predicted, "measured_step_s": measured_step_s,
            "measured_over_predicted": measured_step_s / predicted if measured_step_s and predicted else None,
            **memory_beside(row["memory"]["predicted"][0], train.get("memory"))}


# ------------------------------------------------------------------------------------------------ driver
def _run(name: str, results: dict, out: Path, fn, *args):
    """Run one section into ``results`` and rewrite ``out/gpu_check.json``, so a run cut short keeps what it has."""
    t0 = time.perf_counter()
    print(f"gpu_check: {name} ...", flush=True)
    try:
        results[name] = fn(*args)
    except Exception as exc:  # one section's failure is that section's result; the others still run
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    results[name]["section_s"] = round(time.perf_counter() - t0, 1)
    print(f"gpu_check: {name} done in {results[name]['section_s']} s", flush=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return results[name]


def markdown(results: dict) -> str:
    """One row per section key (the summary keys at the top of the JSON repeat section keys: not shown twice)."""
    rows = ["| section | key | value |", "|---|---|---|"]
    for section, values in results.items():
        if not isinstance(values, dict) or section in SUMMARY:
            continue
        for key, value in values.items():
            if key in ("traceback", "failed_names") or isinstance(value, (dict, list)):
                continue
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            rows.append(f"| {section} | {key} | {shown} |")
    return "\n".join(rows) + "\n"


SECTIONS = ("device", "tests", "gemm", "elementwise", "attention", "train", "generate", "predict", "serve",
            "serve_step")
#: the keys repeated at the top of ``gpu_check.json`` from their sections
MEMORY = ("activations_measured_over_predicted", "device_peak_over_predicted_total")
SUMMARY = ("mfu", "train_tokens_per_s", "hf_train_tokens_per_s", "predicted_step_s", "measured_step_s",
           *MEMORY, "generate_tokens_per_s", "serve_tokens_per_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--quick", action="store_true",
                        help="fewer timed steps (on a CPU: the small sizes anyway, and the predict section reads this "
                             "host's cached profile instead of calibrating)")
    parser.add_argument("--test-files", default=",".join(DEVICE_TESTS),
                        help="comma-separated test files (from the repository root) the tests section runs")
    parser.add_argument("--out", default="gpu-check", help="folder for gpu_check.json, gpu_check.md and logs")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (generate, predict and serve use the "
                             "model train saves: name train with them)")
    args = parser.parse_args()
    wanted = set(args.sections.split(","))
    uses_model = {"generate", "predict", "serve", "serve_step"}
    if not wanted <= set(SECTIONS) or (wanted & uses_model and "train" not in wanted):
        parser.error(f"--sections {args.sections}: choose from {','.join(SECTIONS)}, with train if generate, "
                     "predict, serve or serve_step is chosen")
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: --device cuda but torch.cuda.is_available() is False")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = _sizes(args.quick, device.type == "cuda")
    sys.path.insert(0, str(ROOT / "src"))
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick}
    started = time.perf_counter()
    for name in SECTIONS:
        results[name] = {"skipped": True}
    if "device" in wanted:
        _run("device", results, out, device_section, device)
    if "tests" in wanted:
        _run("tests", results, out, tests_section, device, out, args.test_files.split(","))
    if "gemm" in wanted:
        _run("gemm", results, out, gemm_section, device, args.quick, out)
    if "elementwise" in wanted:
        _run("elementwise", results, out, elementwise_section, device, sizes, args.quick)
    if "attention" in wanted:
        _run("attention", results, out, attention_section, device, sizes, args.quick, out)
    train: dict = {}
    if "train" in wanted:
        folder = Path(tempfile.mkdtemp(prefix="plait-gpu-check-"))
        ctx = _world(device)
        train = _run("train", results, out, train_section, ctx, sizes, folder, out)
        if "generate" in wanted:
            _run("generate", results, out, generate_section, ctx.device, sizes, folder)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        precision = train.get("precision", "bf16" if device.type == "cuda" else "fp32")
        if "predict" in wanted:
            _run("predict", results, out, predict_section, sizes, precision, folder, out, train,
                 device.type == "cuda", args.quick)
        if "serve" in wanted:
            dtype = "bfloat16" if device.type == "cuda" else "float32"  # the generate and serve_step sections'
            _run("serve", results, out, serve_section, sizes, folder, out, _env(), ROOT, dtype)
        if "serve_step" in wanted:
            _run("serve_step", results, out, serve_step_section, ctx.device, sizes, folder, out, _profile)
    flat = {"mfu": train.get("mfu"), "train_tokens_per_s": train.get("train_tokens_per_s"),
            "hf_train_tokens_per_s": train.get("hf_train_tokens_per_s"),
            "predicted_step_s": results["predict"].get("predicted_step_s"),
            "measured_step_s": train.get("measured_step_s"), **{k: results["predict"].get(k) for k in MEMORY},
            "generate_tokens_per_s": results["generate"].get("generate_tokens_per_s"),
            "serve_tokens_per_s": results["serve"].get("serve_tokens_per_s")}
    results = {**flat, **results, "total_s": round(time.perf_counter() - started, 1)}
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(results))
    print(markdown(results))
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    print(f"gpu_check: wrote {out / 'gpu_check.json'} in {results['total_s']} s"
          + (f"; sections that failed: {', '.join(failed)}" if failed else ""))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
