"""Run the user benchmarks of bench/ one after another (each prints its table and JSON): ``make bench``.

The benchmarks left out run on their own (bench/README.md): ``gpu_check.py`` needs a GPU (``make gpu-check``),
``bench/planner/`` many minutes of a calibrated host.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# (script, arguments) in the order they run
ORDER: list[tuple[str, list[str]]] = [
    ("sim.py", []), ("plan.py", []), ("tp.py", []), ("pipeline.py", []), ("optim.py", []), ("experts.py", []),
    ("context.py", []), ("data.py", []), ("generate.py", []), ("serve.py", []),
    ("recovery.py", ["stall"]), ("checksums.py", []),
]
#: scripts of bench/ that run_all does not run, and why
LEFT_OUT = {"run_all.py": "this runner", "pipeline_floor.py": "the workload pipeline.py imports",
            "gpu_check.py": "needs a GPU: make gpu-check", "gpu_check_serve.py": "gpu_check.py's serve section",
            "gpu_check_gemm.py": "gpu_check.py's gemm section",
            "gpu_check_elementwise.py": "gpu_check.py's elementwise section",
            "gpu_check_memory.py": "gpu_check.py's memory check (train and predict sections)",
            "gpu_check_generate.py": "gpu_check.py's generate section",
            "gpu_check_attention.py": "gpu_check.py's attention section"}


def main() -> int:
    here = Path(__file__).parent
    failed = []
    for name, args in ORDER:
        print(f"\n===== bench/{name} {' '.join(args)} =====", flush=True)
        if subprocess.run([sys.executable, str(here / name), *args]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
