"""Builders of the CPU optimizer ops: cpu_adam, cpu_adagrad, cpu_lion.

The three ops are compiled into one extension module (``cpu_optim``): pybind11's fixed compile
cost, which dominates a cold build, is then paid once instead of three times. Each op keeps its
own builder, name and status; building any of them builds (and caches) all three kernels.
"""
from __future__ import annotations

import sys

from .builder import OpBuilder


class _CPUOptimizerBuilder(OpBuilder):
    BUILD_NAME = "cpu_optim"
    EXT_NAME = "cpu_optim_op"
    PACKAGE = "dsplug.ops"
    SOURCES = (("adam/cpu_adam.cpp", "-O3"), ("adagrad/cpu_adagrad.cpp", "-O3"), ("lion/cpu_lion.cpp", "-O3"),
               ("cpu_optim/cpu_optim_bindings.cpp", "-O1"))
    USES_SIMD = True
    BUILD_SECONDS = 15  # measured: 14.5 s of CPU over 4 sources, 2 cores
    KERNEL = ""  # class name in dsplug.ops.native.cpu_optim

    def extra_ldflags(self):
        # dlopen / dlsym (finding torch's OpenMP team, csrc/includes/dsplug_omp_team.h): in libc
        # since glibc 2.34, in libdl before
        return ["-ldl"] if sys.platform.startswith("linux") else []

    def make_module(self, native):
        from dsplug.ops.native import cpu_optim

        return getattr(cpu_optim, self.KERNEL)(native)


class CPUAdamBuilder(_CPUOptimizerBuilder):
    """Adam / AdamW (DeepSpeed's CPU Adam), used by ``dsplug.ops.adam.DeepSpeedCPUAdam``."""

    NAME = "cpu_adam"
    KERNEL = "AdamKernel"


class CPUAdagradBuilder(_CPUOptimizerBuilder):
    """Adagrad, used by ``dsplug.ops.adagrad.DeepSpeedCPUAdagrad``."""

    NAME = "cpu_adagrad"
    KERNEL = "AdagradKernel"


class CPULionBuilder(_CPUOptimizerBuilder):
    """Lion, used by ``dsplug.ops.lion.DeepSpeedCPULion``."""

    NAME = "cpu_lion"
    KERNEL = "LionKernel"
