"""Running experiments: each one is a real ``dsplug launch`` of the user's script, in a subprocess.

Layout (``<name>`` is the experiment's name, e.g. ``z2_mbs8_gas1``)::

    exps_dir/<name>/ds_config.json    the generated config the script is given
    exps_dir/<name>/exp.json          what the experiment is: candidate, paths, command
    results_dir/<name>/metrics.json   written inside the run by the autotuning observer
    results_dir/<name>/result.json    status (done / failed / timeout / pruned / skipped / invalid),
                                      reason, metrics, memory estimate, seconds
    results_dir/<name>/stdout.log, stderr.log, cmd.txt

The script's ``--deepspeed_config`` (or ``--deepspeed``) argument is pointed at the generated
config, and the ``arg_mappings`` flags carry the experiment's values. A single-node experiment
gets a fresh free rendezvous port, so consecutive experiments never wait for the port the
previous one left.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, TextIO

from .observer import write_json_atomic
from .space import Candidate

#: statuses of an experiment that was not launched
NOT_LAUNCHED = ("pruned", "skipped", "invalid")


@dataclass
class Experiment:
    name: str
    candidate: Optional[Candidate]  # None for the model-info run
    config: Dict[str, Any]
    exp_dir: str
    result_dir: str
    output_file: str  # metrics.json or model_info.json, written by the observer
    status: str = "pending"
    reason: str = ""
    metrics: Optional[Dict[str, Any]] = None
    estimate: Optional[Dict[str, Any]] = None
    seconds: Optional[float] = None
    cached: bool = False
    command: List[str] = field(default_factory=list)

    @property
    def config_path(self) -> str:
        return os.path.join(self.exp_dir, "ds_config.json")

    def value(self, metric: str) -> Optional[float]:
        if self.status != "done" or not self.metrics:
            return None
        v = self.metrics.get(metric)
        return None if v is None else float(v)

    def record(self) -> Dict[str, Any]:
        return {"name": self.name, "status": self.status, "reason": self.reason, "cached": self.cached,
                "candidate": None if self.candidate is None else self.candidate.describe(),
                "metrics": self.metrics, "memory_estimate": self.estimate, "seconds": self.seconds,
                "ds_config": self.config_path, "command": self.command}

    def write_description(self) -> None:
        os.makedirs(self.exp_dir, exist_ok=True)
        if self.config:  # a candidate skipped for its batch settings has no config
            write_json_atomic(self.config_path, self.config)
        write_json_atomic(os.path.join(self.exp_dir, "exp.json"),
                          {"name": self.name, "candidate": None if self.candidate is None else self.candidate.describe(),
                           "ds_config": self.config_path, "output": self.output_file,
                           "result_dir": self.result_dir, "command": self.command})

    def write_result(self) -> None:
        os.makedirs(self.result_dir, exist_ok=True)
        write_json_atomic(os.path.join(self.result_dir, "result.json"), self.record())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def tail(path: str, lines: int = 3) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()[-4000:]
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept)


class LaunchRunner:
    """Runs an experiment as ``python -m dsplug.cli launch FLAGS SCRIPT ARGS`` and collects its outcome."""

    def __init__(self, flags_for, script: str, args_for, *, python: Optional[str] = None, cwd: Optional[str] = None,
                 timeout: Optional[float] = None, environ: Optional[Dict[str, str]] = None):
        self.flags_for = flags_for  # () -> launcher flags (a fresh port each call where it applies)
        self.script = script
        self.args_for = args_for  # experiment -> the script's arguments
        self.python = python or sys.executable
        self.cwd = cwd or os.getcwd()
        self.timeout = timeout
        self.environ = dict(os.environ if environ is None else environ)
        self.environ["PYTHONUNBUFFERED"] = "1"

    def command(self, exp: Experiment) -> List[str]:
        return [self.python, "-m", "dsplug.cli", "launch", *self.flags_for(), self.script, *self.args_for(exp)]

    def reuse(self, exp: Experiment) -> bool:
        """With ``overwrite`` false: take the recorded outcome when the same config already ran."""
        previous = read_json(exp.config_path)
        output = read_json(exp.output_file)
        if previous is None or output is None or previous != json.loads(json.dumps(exp.config)):
            return False
        exp.metrics, exp.status, exp.cached, exp.seconds = output, "done", True, 0.0
        old = read_json(os.path.join(exp.result_dir, "result.json")) or {}
        exp.command = old.get("command") or exp.command
        return True

    def run(self, exp: Experiment) -> None:
        """Launch ``exp.command`` (:meth:`command` when empty); sets status, reason, metrics, seconds.

        A single-node launch whose rendezvous port was taken between choosing it and binding it
        (another program on the machine) is launched once more on a fresh port."""
        exp.command = exp.command or self.command(exp)
        self._run_once(exp)
        if exp.status == "failed" and _port_taken(os.path.join(exp.result_dir, "stderr.log")):
            exp.command = self.command(exp)
            self._run_once(exp)

    def _run_once(self, exp: Experiment) -> None:
        exp.status, exp.reason, exp.metrics = "running", "", None
        os.makedirs(exp.result_dir, exist_ok=True)
        if os.path.exists(exp.output_file):
            os.remove(exp.output_file)  # a stale result must not pass for this run's
        with open(os.path.join(exp.result_dir, "cmd.txt"), "w") as f:
            f.write(shlex.join(exp.command) + "\n")
        out_path = os.path.join(exp.result_dir, "stdout.log")
        err_path = os.path.join(exp.result_dir, "stderr.log")
        start = time.monotonic()
        with open(out_path, "w") as out, open(err_path, "w") as err:
            # a session of its own: stopping it reaches the launcher's workers and anything they
            # started (the process group), not only the launcher
            proc = subprocess.Popen(exp.command, stdout=out, stderr=err, cwd=self.cwd, env=self.environ,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                code = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                _stop(proc)
                exp.seconds = time.monotonic() - start
                exp.status = "timeout"
                exp.reason = f"stopped after autotuning.experiment_timeout {self.timeout:g} s"
                return
            except BaseException:
                _stop(proc)
                raise
        exp.seconds = time.monotonic() - start
        exp.metrics = read_json(exp.output_file)
        if code == 0 and exp.metrics is not None:
            exp.status = "done"
        elif exp.metrics is not None and code in (134, 128 + 6, -6):
            # measured, then a worker aborted at interpreter exit (the gloo worker-thread race that
            # dsplug.comm's exit hook closes; a script may still exit past it, e.g. os._exit after
            # pending async collectives): the measurement stands
            exp.status = "done"
            exp.reason = f"measured; the launch then exited with status {code} at teardown (see {err_path})"
        elif code == 0:
            exp.status = "failed"
            exp.reason = ("the run ended without writing its measurement: does the script run optimizer steps "
                          f"through the engine past end_profile_step (steps count from 0)? (see {out_path})")
        else:
            exp.status = "failed"
            exp.reason = f"exit status {code}: {tail(err_path) or 'no output'} (see {err_path})"


def _port_taken(stderr_path: str) -> bool:
    try:
        with open(stderr_path, errors="replace") as f:
            text = f.read()[-20000:]
    except OSError:
        return False
    return "EADDRINUSE" in text or "Address already in use" in text


def _stop(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """Stop a running ``dsplug launch`` and everything it started: SIGTERM to its process group
    (the launcher passes it on to its workers), up to ``grace`` seconds for the launcher to end,
    then SIGKILL to the group (stragglers included) and the launcher reaped.

    The launcher is reaped only after the group was killed: until then its pid, which is the
    group's id, cannot be reused by another process."""
    if proc.returncode is not None:
        return  # already reaped: its pid (the group id) may belong to another process by now
    pgid = proc.pid  # start_new_session: the launcher leads its own group
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while not _exited(proc) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal_group(pgid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the process ended, without reaping it (its pid stays reserved)."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


class Progress:
    """One line per experiment with its status; on a terminal the running line is rewritten in place."""

    def __init__(self, stream: Optional[TextIO] = None, metric: str = "throughput"):
        self.stream = stream or sys.stdout
        self.metric = metric
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._open = False

    def say(self, text: str) -> None:
        self._close()
        print(text, file=self.stream, flush=True)

    def running(self, index: str, exp: Experiment) -> None:
        self._close()
        text = f"[{index}] {exp.name:<34} running ..."
        if self.tty:
            self.stream.write(text)
            self.stream.flush()
            self._open = True
        else:
            print(text, file=self.stream, flush=True)

    def finished(self, index: str, exp: Experiment) -> None:
        if self._open:
            self.stream.write("\r\033[K")
            self._open = False
        print(f"[{index}] {exp.name:<34} {self.detail(exp)}", file=self.stream, flush=True)

    def detail(self, exp: Experiment) -> str:
        if exp.status == "done":
            if exp.metrics and "latency" in exp.metrics:
                m = exp.metrics
                flops = "-" if m.get("flops") is None else f"{m['flops']:.4g}"
                text = (f"done     latency {m['latency']:.4g} ms  throughput {m['throughput']:.4g} samples/s  "
                        f"flops {flops}")
            else:
                text = "done"
            took = " (cached)" if exp.cached else (f" ({exp.seconds:.1f} s)" if exp.seconds is not None else "")
            return text + took
        return f"{exp.status:<8} {exp.reason}"

    def _close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self._open = False
