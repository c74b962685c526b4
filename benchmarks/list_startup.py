"""Wall time of `dsplug list` (a fresh interpreter: discovery, plugin imports, op status).

Baseline in the same run: a fresh interpreter that only does `import torch`. Target for
`dsplug list`: under 2.5 s on the 2-core dev machine, torch import included if it happens.
`dsplug list`, `--help` and `config check` import no torch (tests/core/test_cli_without_torch.py),
so their ratio to the baseline stays well under 1 however many plugins are installed.

    python benchmarks/list_startup.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time


def wall(cmd, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    dsplug = shutil.which("dsplug")
    cmd = [dsplug, "list"] if dsplug else [sys.executable, "-m", "dsplug.cli", "list"]
    baseline = wall([sys.executable, "-c", "import torch"], args.repeat)
    listing = wall(cmd, args.repeat)
    help_time = wall(cmd[:-1] + ["--help"], args.repeat)
    version_time = wall(cmd[:-1] + ["--version"], args.repeat)
    imports_torch = subprocess.run(
        [sys.executable, "-c", "import sys; from dsplug.cli import main; main(['list']); "
         "print('TORCH' if 'torch' in sys.modules else 'NOTORCH')"], capture_output=True, text=True).stdout
    print(f"median of {args.repeat} runs")
    print(f"  baseline `python -c 'import torch'` : {baseline:6.3f} s")
    print(f"  `dsplug list`                       : {listing:6.3f} s   (target < 2.5 s; "
          f"{'imports' if 'NOTORCH' not in imports_torch else 'does not import'} torch)")
    print(f"  `dsplug --help`                     : {help_time:6.3f} s")
    print(f"  `dsplug --version`                  : {version_time:6.3f} s")
    print(f"  ratio list / torch import           : {listing / baseline:6.3f}x")
    print(f"  ratio --help / torch import         : {help_time / baseline:6.3f}x")


if __name__ == "__main__":
    main()
