"""``dsplug report``: environment and native-op report, in the spirit of ``ds_report``."""
from __future__ import annotations

import platform
import shutil
import sys


def add_parser(subparsers):
    p = subparsers.add_parser("report", help="environment, accelerator and native-op report")
    p.set_defaults(func=run)


def run(args) -> int:
    import pluggy
    import torch

    import dsplug
    from dsplug.accelerator import get_accelerator
    from dsplug.cli.cmd_list import op_states
    from dsplug.registry import get_registry

    registry = get_registry()
    accel = get_accelerator()
    print("dsplug environment report")
    print("-" * 60)
    rows = [
        ("dsplug", f"{dsplug.__version__} ({dsplug.__file__.rsplit('/', 1)[0]})"),
        ("python", f"{sys.version.split()[0]} ({sys.executable})"),
        ("platform", platform.platform()),
        ("torch", f"{torch.__version__} ({torch.__file__.rsplit('/', 1)[0]})"),
        ("torch cuda", str(torch.version.cuda)),
        ("pluggy", pluggy.__version__),
        ("accelerator", f"{accel.name} (backend {accel.communication_backend_name()}, {accel.device_count()} device(s))"),
        ("gloo available", str(torch.distributed.is_available() and torch.distributed.is_gloo_available())),
        ("nccl available", str(torch.distributed.is_available() and torch.distributed.is_nccl_available())),
        ("c++ compiler", shutil.which("c++") or shutil.which("g++") or "not found"),
        ("ninja", shutil.which("ninja") or _module_version("ninja")),
        ("pybind11", _module_version("pybind11")),
        ("plugins", f"{len(registry.all())} from {len({p.distribution for p in registry.all()})} distribution(s)"),
    ]
    for name, value in rows:
        print(f"{name:<16} {value}")
    try:
        from dsplug.op_builder import ALL_OPS
        names = sorted(ALL_OPS)
    except ImportError:
        names = []
    print("-" * 60)
    print(f"{'native op':<16} {'compatible':<11} {'built':<6} detail")
    for name, st in op_states(names).items():
        print(f"{name:<16} {('yes' if st['compatible'] else 'no'):<11} {('yes' if st['built'] else 'no'):<6} {st['detail']}")
    for ep, dist, err in registry.broken:
        print(f"broken plugin: {ep} ({dist}): {err}")
    return 0


def _module_version(name: str) -> str:
    try:
        module = __import__(name)
    except ImportError:
        return "not installed"
    return getattr(module, "__version__", "installed")
