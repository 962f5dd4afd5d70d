"""Run every benchmark in bench/ one after another (each prints its table and JSON)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ORDER = ["sim.py", "plan.py", "tp.py", "pipeline.py", "optim.py", "experts.py", "train.py", "generate.py", "serve.py",
         "serve_policy.py"]


def main() -> int:
    here = Path(__file__).parent
    failed = []
    for name in ORDER:
        path = here / name
        if not path.exists():
            continue
        print(f"\n===== bench/{name} =====", flush=True)
        if subprocess.run([sys.executable, str(path)]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
