#!/usr/bin/env bash
# The GPU device check (issue 27): installs dsplug from this working tree (offline) and runs
# benchmarks/device_check.py, every line also written to $OUT/device_check.log.
#
#   bash benchmarks/device_check.sh                      # on the GPU machine (needs python3 with torch+CUDA)
#   DEVICE_CHECK_DRY=1 bash benchmarks/device_check.sh   # every check on CPU / gloo, tiny sizes
#   bash benchmarks/device_check.sh --only stages_bf16,offload
#
# Environment: PYTHON (default python3), OUT (default /tmp/device_check_out), DEVICE_CHECK_BUDGET_S
# (seconds for the checks, default 420), DEVICE_CHECK_SKIP_INSTALL=1 (dsplug already installed).
# Assumes on the machine: torch with CUDA and NCCL, pluggy, attrs, setuptools (for the editable
# install; without it dsplug is put on PYTHONPATH with its entry points by hand), and for the
# native ops a C++ compiler, ninja and pybind11 (else their pure-torch fallbacks run, and it says so).
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python3}"
OUT="${OUT:-/tmp/device_check_out}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
LOG="$OUT/device_check.log"

install_dsplug() {
    local here where
    here="$(pwd)"
    where="$("$PY" -c 'import dsplug, os; print(os.path.dirname(os.path.dirname(os.path.abspath(dsplug.__file__))))' 2>/dev/null)"
    if [ "$where" = "$here" ]; then
        echo "dsplug: already installed from this working tree ($where)"
        return 0
    fi
    if [ -n "$DEVICE_CHECK_SKIP_INSTALL" ]; then
        echo "dsplug: DEVICE_CHECK_SKIP_INSTALL set; using the installed one (${where:-none})"
        return 0
    fi
    echo "dsplug: pip install --no-deps --no-build-isolation --no-index -e . (offline)"
    if timeout 180 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -20 \
        && "$PY" -c 'import dsplug.plugins, importlib.metadata as m; assert m.entry_points(group="dsplug")' ; then
        echo "dsplug: installed (editable)"
        return 0
    fi
    echo "dsplug: the editable install failed; putting the tree on PYTHONPATH with a hand-made dist-info"
    local site=/tmp/device_check_site
    "$PY" benchmarks/device_check_site.py "$site" || return 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" -c 'import dsplug; print("dsplug: importable from", dsplug.__file__)'
}

{
    echo "=== device_check.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd)"
    echo "=== nvidia-smi"
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
    echo "=== $PY: $(command -v "$PY") $("$PY" --version 2>&1)"
    "$PY" -m pip --version 2>&1
    "$PY" -c 'import torch, pluggy, attrs; print("torch", torch.__version__, "pluggy", pluggy.__version__, "attrs", attrs.__version__)' 2>&1
    echo "toolchain: c++ $(command -v c++ || echo missing), ninja $(command -v ninja || echo missing), $("$PY" -c 'import pybind11; print("pybind11", pybind11.__version__)' 2>&1 | tail -1)"
    echo "=== install"
    install_dsplug || { echo "FAIL: install: dsplug could not be installed"; exit 3; }
    echo "=== checks"
    "$PY" benchmarks/device_check.py "$@"
} 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
echo "log: $LOG (exit $status)"
exit "$status"
