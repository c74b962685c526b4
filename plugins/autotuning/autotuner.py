"""The autotuner behind ``dsplug launch --autotuning tune|run``.

1. **Model info.** Unless ``autotuning.model_info.num_params`` is given, one short run of the
   script (``profile_model_info``: the highest ZeRO stage tuned, the smallest micro-batch) counts
   the parameters and the activation bytes per sample (see :mod:`.observer`).
2. **Candidates.** :mod:`.space` turns the user's config into (stage, micro-batch, knobs)
   candidates; each becomes a full config, is validated like any config (an invalid one is
   recorded, not run) and is checked against the memory budget (:mod:`.memory`): what does not
   fit is recorded as ``pruned`` and never launched.
3. **Experiments.** The tuner (:mod:`.tuner`) picks the order; each experiment is a real
   ``dsplug launch`` of the script (:mod:`.runner`) measured between the profile steps. The
   tuning stops when the pool is empty, after ``tuner_num_trials`` experiments, or after
   ``tuner_early_stopping`` experiments in a row without a better result.
4. **Knobs** (``fast: false``): the stage knobs of the best (stage, micro-batch) are then tuned
   over their grid, under the same budget.
5. **Results.** A ranked table is printed and written (``summary.txt``, ``summary.json``), the
   best config is written to ``results_dir/ds_config_optimal.json`` with the command that runs
   it (``cmd_optimal.txt``); ``run`` then launches that command.
"""
from __future__ import annotations

import os
import shlex
import sys
import warnings
from typing import Any, Dict, List, Optional, TextIO

from .config import AutotuningConfig
from .memory import device_budget, fits, format_bytes, largest_micro_batch, model_state_bytes
from .observer import write_json_atomic
from .report import UNITS, format_table, rank
from .runner import NOT_LAUNCHED, Experiment, LaunchRunner, Progress, free_port, read_json
from .space import (AutotuningError, Candidate, batch_for, default_knobs, experiment_config, find_config_arg,
                    fixed_batch_sizes, geometric_sizes, knob_grid, optimal_config, read_space, snap_sizes,
                    with_config_arg, with_mapped_args)
from .tuner import HIGHER_IS_BETTER, Budget, explore, make_tuner

PROFILE_RUN = "profile_model_info"


def _launch_flag_values(args) -> Dict[str, Any]:
    """The ``dsplug launch`` options of ``args`` that experiments repeat (missing ones: their defaults)."""
    names = ("num_gpus", "num_procs", "num_nodes", "hostfile", "include", "exclude", "master_addr", "master_port",
             "no_local_rank", "module", "no_python", "force_multi", "ssh_port")
    return {name: getattr(args, name, None) for name in names}


class Autotuner:
    """DeepSpeed's ``Autotuner(args, active_resources)``: ``args`` are the ``dsplug launch`` arguments
    (``user_script``, ``user_args``, the launcher flags), ``active_resources`` the ``{host: [slot, ...]}``
    the launch would use. ``tune()``, ``print_tuning_results()``, ``write_optimal_config()``,
    ``run_after_tuning()``."""

    def __init__(self, args, active_resources: Dict[str, List[int]], *, stream: Optional[TextIO] = None,
                 python: Optional[str] = None, cwd: Optional[str] = None, runner=None):
        from dsplug.config.loader import load_raw
        from dsplug.config.schema import parse

        self.args = args
        self.stream = stream or sys.stdout
        self.python = python or sys.executable
        self.cwd = os.path.abspath(cwd or os.getcwd())
        self.script = args.user_script
        self.user_args = list(args.user_args or [])
        self.flags = _launch_flag_values(args)
        self.config_index, config_arg = find_config_arg(self.user_args)
        self.user_config_path = os.path.join(self.cwd, config_arg)
        if not os.path.isfile(self.user_config_path):
            raise AutotuningError(f"the script's DeepSpeed config {config_arg!r} does not exist (looked in {self.cwd})")
        self.user_config, _ = load_raw(self.user_config_path)
        section = self.user_config.get("autotuning") or {}
        self.section_raw: Dict[str, Any] = dict(section)
        self.at: AutotuningConfig = parse(AutotuningConfig, section, "autotuning")
        self.metric = self.at.metric
        self.space = read_space(self.user_config, self.at.fast)
        self.resources = self._experiment_resources(active_resources)
        self.world_size = sum(len(slots) for slots in self.resources.values())
        self.procs_per_node = max(len(slots) for slots in self.resources.values())
        if self.world_size % self.at.mp_size:
            raise AutotuningError(f"autotuning.mp_size {self.at.mp_size} does not divide the {self.world_size} "
                                  f"processes of the experiments")
        self.dp_world = self.world_size // self.at.mp_size
        self.multi_node = len(self.resources) > 1 or bool(self.flags.get("force_multi"))
        self.results_dir = os.path.join(self.cwd, self.at.results_dir or "autotuning_results")
        self.exps_dir = os.path.join(self.cwd, self.at.exps_dir or "autotuning_exps")
        seed = self.user_config.get("seed")
        self.seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else None
        self.progress = Progress(self.stream, self.metric)
        # ``runner``: what runs an experiment (``run(exp)``, ``reuse(exp)``, ``command(exp)``); by default a
        # real ``dsplug launch`` of the script (tests of the orchestration pass a stand-in)
        self.runner = runner or LaunchRunner(self._flags, self.script, self._script_args, python=self.python,
                                             cwd=self.cwd, timeout=self.at.experiment_timeout)
        self.experiments: List[Experiment] = []  # every candidate considered, in the order decided
        self.model_info: Optional[Dict[str, Any]] = None
        self.budget_bytes: Optional[int] = None
        self.budget_source = ""
        self.stop_reason = "every candidate was tried"
        self.best: Optional[Experiment] = None
        self._index = 0
        self._pool_size = 0

    # ------------------------------------------------------------------ resources and commands
    @property
    def exp_num_nodes(self) -> int:
        """DeepSpeed's name: how many nodes the experiments run on."""
        return len(self.resources)

    @property
    def exp_num_gpus(self) -> int:
        """DeepSpeed's name: the per-node slot count of the experiments, the fewest slots any of their
        nodes has (dsplug launches each node with its own slots, so on uneven nodes the larger ones
        run more processes; ``world_size`` is the total)."""
        return min(len(slots) for slots in self.resources.values())

    def _experiment_resources(self, active: Dict[str, List[int]]) -> Dict[str, List[int]]:
        hosts = list(active.items())
        if not hosts:
            raise AutotuningError("the launch has no resources to run experiments on")
        if self.at.num_nodes is not None:
            if self.at.num_nodes > len(hosts):
                raise AutotuningError(f"autotuning.num_nodes {self.at.num_nodes} is more than the {len(hosts)} "
                                      f"node(s) of the launch")
            hosts = hosts[: self.at.num_nodes]
        if self.at.num_gpus is not None:
            short = [h for h, slots in hosts if len(slots) < self.at.num_gpus]
            if short:
                raise AutotuningError(f"autotuning.num_gpus {self.at.num_gpus} is more than node {short[0]!r} has "
                                      f"in the launch")
            hosts = [(h, list(slots)[: self.at.num_gpus]) for h, slots in hosts]
        if (self.at.num_nodes is not None or self.at.num_gpus is not None) and \
                (self.flags.get("include") or self.flags.get("exclude")):
            raise AutotuningError("autotuning.num_nodes / num_gpus cannot be combined with --include / --exclude; "
                                  "name the hosts and slots in the filter instead")
        return dict(hosts)

    def _flags(self, port: Optional[int] = None, *, for_display: bool = False) -> List[str]:
        """The launcher flags of an experiment (a fresh free port on one node) or of the final run."""
        f = self.flags
        out: List[str] = []
        if f.get("hostfile"):
            out += ["--hostfile", str(f["hostfile"])]
        if f.get("include"):
            out += ["--include", str(f["include"])]
        if f.get("exclude"):
            out += ["--exclude", str(f["exclude"])]
        nodes = self.at.num_nodes or f.get("num_nodes")
        if nodes:
            out += ["--num_nodes", str(nodes)]
        procs = self.at.num_gpus or f.get("num_gpus") or f.get("num_procs")
        if procs:
            out += ["--num_procs" if f.get("num_procs") and not f.get("num_gpus") else "--num_gpus", str(procs)]
        if f.get("master_addr"):
            out += ["--master_addr", str(f["master_addr"])]
        if port is None and not for_display and not self.multi_node:
            port = free_port()
        if port is None:
            port = f.get("master_port")
        if port is not None:
            out += ["--master_port", str(port)]
        if f.get("ssh_port"):
            out += ["--ssh_port", str(f["ssh_port"])]
        for name in ("no_local_rank", "module", "no_python", "force_multi"):
            if f.get(name):
                out.append(f"--{name}")
        return out

    def _script_args(self, exp: Experiment) -> List[str]:
        args = with_config_arg(self.user_args, self.config_index, exp.config_path)
        return with_mapped_args(args, self.at.arg_mappings, exp.config)

    # ------------------------------------------------------------------ experiments
    def _experiment(self, name: str, cand: Optional[Candidate], config: Dict[str, Any], output: str) -> Experiment:
        return Experiment(name=name, candidate=cand, config=config, exp_dir=os.path.join(self.exps_dir, name),
                          result_dir=os.path.join(self.results_dir, name),
                          output_file=os.path.join(self.results_dir, name, output))

    def _section(self, **changes) -> Dict[str, Any]:
        section = {k: v for k, v in self.section_raw.items() if k not in ("metric_path", "model_info_path")}
        info = dict(section.get("model_info") or {})
        info.pop("profile", None)
        section["model_info"] = info or None
        if section["model_info"] is None:
            section.pop("model_info")
        section["enabled"] = True
        section.update(changes)
        return section

    def _metric_experiment(self, cand: Candidate) -> Experiment:
        metric_path = os.path.join(self.results_dir, cand.name, "metrics.json")
        config = experiment_config(self.user_config, cand, self._section(metric_path=metric_path))
        return self._experiment(cand.name, cand, config, "metrics.json")

    def _launch(self, exp: Experiment, label: str) -> None:
        exp.command = self.runner.command(exp)
        if not self.at.overwrite and self.runner.reuse(exp):
            self.progress.finished(label, exp)
            exp.write_result()
            return
        exp.write_description()
        self.progress.running(label, exp)
        self.runner.run(exp)
        self.progress.finished(label, exp)
        exp.write_result()

    # ------------------------------------------------------------------ step 1: model info
    def _model_info(self) -> Dict[str, Any]:
        given = self.at.model_info.num_params if self.at.model_info is not None else None
        if given is not None:
            return {"num_params": given / self.at.mp_size, "activation_mem_per_sample": 0.0,
                    "source": "autotuning.model_info.num_params (activation memory taken as 0)"}
        cand = self._profile_candidate()
        exp = self._experiment(PROFILE_RUN, cand, self._profile_config(cand), "model_info.json")
        self._launch(exp, "model info")
        if exp.status != "done":
            raise AutotuningError(f"the model-info run ({cand.name}) did not complete: {exp.status}: {exp.reason}")
        info = dict(exp.metrics or {})
        info["source"] = f"model-info run {cand.name}"
        return info

    def _profile_candidate(self) -> Candidate:
        """The least memory-hungry candidate whose config is valid: the highest stage tuned that the
        config check accepts (a stage the optimizer refuses, e.g. a 1-bit optimizer above stage 0, is
        passed over), at the smallest valid micro-batch size."""
        from dsplug.config import ConfigError, DsplugConfig

        sizes = self.space.micro_batches or range(self.at.min_train_micro_batch_size_per_gpu,
                                                  self.at.max_train_micro_batch_size_per_gpu + 1)
        reasons = []
        for micro in sizes:
            batch, why = batch_for(self.space, micro, self.dp_world)
            if batch is not None:
                break
            reasons.append(why)
            if len(reasons) > 10_000:
                break
        else:
            batch = None
        if batch is None:
            raise AutotuningError(f"no micro-batch size to tune fits the batch settings: {reasons[0]}")
        errors = []
        for stage in sorted(self.space.stages, reverse=True):
            cand = Candidate(stage, micro, batch[0], batch[1], default_knobs(self.space, stage, self.at.fast))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    DsplugConfig(self._profile_config(cand), world_size=self.dp_world)
            except ConfigError as exc:
                errors.append(f"stage {stage}: {' '.join(str(exc).split())}")
                continue
            return cand
        raise AutotuningError("no ZeRO stage tuned has a valid config for the model-info run; "
                              + "; ".join(errors))

    def _profile_config(self, cand: Candidate) -> Dict[str, Any]:
        path = os.path.join(self.results_dir, PROFILE_RUN, "model_info.json")
        section = self._section(model_info={**(self.section_raw.get("model_info") or {}), "profile": True},
                                model_info_path=path)
        return experiment_config(self.user_config, cand, section)

    # ------------------------------------------------------------------ step 2: candidates
    def _check(self, cand: Candidate) -> Experiment:
        """The experiment of ``cand`` with its status decided before any launch: pending, or
        skipped (batch bounds) / invalid (config error) / pruned (memory)."""
        from dsplug.config import ConfigError

        exp = self._metric_experiment(cand)
        at = self.at
        if cand.train_batch < at.min_train_batch_size or \
                (at.max_train_batch_size is not None and cand.train_batch > at.max_train_batch_size):
            exp.status = "skipped"
            exp.reason = (f"train batch {cand.train_batch} is outside autotuning.min_train_batch_size "
                          f"{at.min_train_batch_size} .. max_train_batch_size {at.max_train_batch_size}")
            return exp
        try:
            estimate = fits(exp.config, cand.micro_batch, self.model_info["num_params"], self.dp_world,
                            self.model_info.get("activation_mem_per_sample", 0.0), self.budget_bytes)
        except ConfigError as exc:
            exp.status, exp.reason = "invalid", " ".join(str(exc).split())
            return exp
        exp.estimate = estimate
        if not estimate["fits"]:
            exp.status = "pruned"
            exp.reason = (f"needs {format_bytes(estimate['total'])} per device (model states "
                          f"{format_bytes(estimate['model_states'])} + activations "
                          f"{format_bytes(estimate['activations'])}) > budget {format_bytes(estimate['budget'])}")
        return exp

    def _stage_sizes(self, stage: int) -> List[int]:
        """Micro-batch sizes to try at ``stage``: the user's list, or the geometric range up to what fits.

        With a fixed ``train_batch_size`` the range ends at ``train_batch_size / (dp x gas)`` (gas: the
        fixed accumulation steps, else 1) and each size is snapped to the nearest one the batch allows
        (a divisor of ``train_batch_size / dp``), so that the sizes tried are not all skipped."""
        if self.space.micro_batches is not None:
            return list(self.space.micro_batches)
        from dsplug.config import ConfigError

        at = self.at
        lo, cap = at.min_train_micro_batch_size_per_gpu, at.max_train_micro_batch_size_per_gpu
        allowed = fixed_batch_sizes(self.space, self.dp_world)
        if allowed is not None:
            cap = min(cap, self.space.fixed_train_batch // (self.dp_world * (self.space.fixed_gas or 1)))
            allowed = [v for v in allowed if lo <= v <= cap]
            if not allowed:
                return [lo]  # batch_for says why no size fits the fixed batch
            lo = allowed[0]
        elif at.max_train_batch_size is not None:
            cap = min(cap, at.max_train_batch_size // ((self.space.fixed_gas or 1) * self.dp_world))
        probe = Candidate(stage, lo, 1, lo * self.dp_world, default_knobs(self.space, stage, at.fast))
        try:
            states = model_state_bytes(self._metric_experiment(probe).config, self.model_info["num_params"],
                                       self.dp_world)["bytes"]
        except ConfigError:
            return [lo]  # _check records the config error for this stage
        hi = largest_micro_batch(states, self.model_info.get("activation_mem_per_sample", 0.0), self.budget_bytes, cap)
        if hi < lo:
            return [lo]  # does not fit: _check records it as pruned
        sizes = geometric_sizes(lo, hi, at.num_tuning_micro_batch_sizes)
        if allowed is not None:
            sizes = snap_sizes(sizes, [v for v in allowed if v <= hi])
        return sizes

    def candidates(self) -> List[Experiment]:
        """Phase 1: every (stage, micro-batch) with the default knobs, each checked."""
        out, seen = [], set()
        for stage in self.space.stages:
            knobs = default_knobs(self.space, stage, self.at.fast)
            for micro in self._stage_sizes(stage):
                batch, why = batch_for(self.space, micro, self.dp_world)
                if batch is None:
                    cand = Candidate(stage, micro, 0, 0, knobs)
                    exp = self._experiment(cand.name, cand, {}, "metrics.json")
                    exp.status, exp.reason = "skipped", why
                else:
                    cand = Candidate(stage, micro, batch[0], batch[1], knobs)
                    exp = self._check(cand)
                if cand.name not in seen:
                    seen.add(cand.name)
                    out.append(exp)
        return out

    # ------------------------------------------------------------------ step 3: tuning
    def tune(self) -> Optional[Experiment]:
        """Run the tuning; returns the best experiment (None when none succeeded)."""
        os.makedirs(self.results_dir, exist_ok=True)
        os.makedirs(self.exps_dir, exist_ok=True)
        at = self.at
        self.progress.say(f"dsplug autotuning: {self.script} on {self.world_size} process(es) "
                          f"({self.dp_world} data-parallel), metric {self.metric} ({UNITS[self.metric]}), "
                          f"tuner {at.tuner_type}, at most {at.tuner_num_trials} experiments, early stopping after "
                          f"{at.tuner_early_stopping}; results in {self._rel(self.results_dir)}")
        self.model_info = self._model_info()
        self.budget_bytes, self.budget_source = device_budget(at.device_memory, self.procs_per_node)
        self.progress.say(f"model: {int(self.model_info['num_params']):,} parameters per rank, "
                          f"{format_bytes(self.model_info.get('activation_mem_per_sample', 0.0))} of activations per "
                          f"sample ({self.model_info['source']}); memory budget {format_bytes(self.budget_bytes)} per "
                          f"device ({self.budget_source})")
        phase1 = self.candidates()
        budget = Budget(at.tuner_num_trials, at.tuner_early_stopping, self.metric)
        self._run_pool(phase1, budget)
        best = self._best()
        if not at.fast and best is not None and not budget.exhausted():
            self._run_pool(self._knob_candidates(best), budget)
        if budget.stop_reason is not None:
            self.stop_reason = budget.stop_reason
        self.best = self._best()
        self._write_summary()
        return self.best

    def _run_pool(self, exps: List[Experiment], budget: Budget) -> None:
        ready = [e for e in exps if e.status == "pending"]
        for exp in exps:
            if exp.status in NOT_LAUNCHED:
                self.experiments.append(exp)
                exp.write_description()
                exp.write_result()
                self.progress.finished("--", exp)
        if not ready:
            return
        by_cand = {e.candidate: e for e in ready}
        tuner = make_tuner(self.at.tuner_type, [e.candidate for e in ready], self.metric, self.seed)
        self._pool_size += len(ready)

        def evaluate(cand: Candidate) -> Optional[float]:
            exp = by_cand[cand]
            self._index += 1
            self._launch(exp, f"{self._index}/{self._pool_size}")
            self.experiments.append(exp)
            return exp.value(self.metric)

        explore(tuner, budget, evaluate)
        for cand in tuner.pending:  # left by the budget
            exp = by_cand[cand]
            exp.status, exp.reason = "not run", budget.stop_reason or ""
            self.experiments.append(exp)
            exp.write_description()
            exp.write_result()

    def _knob_candidates(self, best: Experiment) -> List[Experiment]:
        """Phase 2 (``fast: false``): the knob grid of the best stage at its best micro-batch size."""
        c = best.candidate
        tried = {e.candidate for e in self.experiments}
        out = []
        for knobs in knob_grid(self.space, c.stage):
            cand = Candidate(c.stage, c.micro_batch, c.gas, c.train_batch, knobs)
            if cand not in tried:
                out.append(self._check(cand))
        if out:
            self.progress.say(f"tuning the ZeRO stage {c.stage} knobs at micro-batch {c.micro_batch}: "
                              f"{len(out)} combination(s)")
        return out

    def _best(self) -> Optional[Experiment]:
        ranked = rank(self.experiments, self.metric)
        return ranked[0] if ranked else None

    # ------------------------------------------------------------------ step 5: results
    def ranking(self) -> List[Experiment]:
        return rank(self.experiments, self.metric)

    def table(self) -> str:
        """The ranked results as printed (and written to ``summary.txt``)."""
        return format_table(self.experiments, self.metric, self.stop_reason)

    def print_tuning_results(self) -> None:
        self.progress.say(self.table())

    def _write_summary(self) -> None:
        ranking = self.ranking()
        summary = {
            "metric": self.metric, "units": UNITS[self.metric], "higher_is_better": HIGHER_IS_BETTER[self.metric],
            "best": None if self.best is None else self.best.name,
            "ranking": [{"rank": i, "name": e.name, **e.candidate.describe(), "metrics": e.metrics}
                        for i, e in enumerate(ranking, 1)],
            "not_measured": [{"name": e.name, "status": e.status, "reason": e.reason} for e in self.experiments
                             if e.value(self.metric) is None],
            "experiments_run": sum(1 for e in self.experiments if e.status in ("done", "failed", "timeout")),
            "stop_reason": self.stop_reason, "model_info": self.model_info,
            "memory_budget": {"bytes": self.budget_bytes, "source": self.budget_source},
            "world_size": self.world_size, "data_parallel_size": self.dp_world,
        }
        write_json_atomic(os.path.join(self.results_dir, "summary.json"), summary)
        with open(os.path.join(self.results_dir, "summary.txt"), "w") as f:
            f.write(self.table() + "\n")

    def optimal_command(self) -> List[str]:
        """The ``dsplug launch`` command line that trains with the optimal config."""
        path = self._rel(os.path.join(self.results_dir, "ds_config_optimal.json"))
        args = with_config_arg(self.user_args, self.config_index, path)
        args = with_mapped_args(args, self.at.arg_mappings, self.best.config)
        return ["dsplug", "launch", *self._flags(for_display=True), self.script, *args]

    def write_optimal_config(self) -> Optional[str]:
        """``results_dir/ds_config_optimal.json`` and ``cmd_optimal.txt``; returns the config's path."""
        if self.best is None:
            return None
        path = os.path.join(self.results_dir, "ds_config_optimal.json")
        write_json_atomic(path, optimal_config(self.best.config))
        command = shlex.join(self.optimal_command())
        with open(os.path.join(self.results_dir, "cmd_optimal.txt"), "w") as f:
            f.write(command + "\n")
        self.progress.say(f"optimal config: {self._rel(path)}\nrun it with: {command}")
        return path

    def run_after_tuning(self) -> int:
        """Launch the training with the optimal config (``--autotuning run``); its exit status."""
        import subprocess

        if self.best is None:
            return 1
        command = [self.python, "-m", "dsplug.cli", *self.optimal_command()[1:]]
        self.progress.say("dsplug autotuning: launching the training with the optimal config")
        return subprocess.call(command, cwd=self.cwd)

    def _rel(self, path: str) -> str:
        rel = os.path.relpath(path, self.cwd)
        return path if rel.startswith("..") else rel


def run_autotuning(args, active_resources: Dict[str, List[int]], *, stream: Optional[TextIO] = None) -> int:
    """``dsplug launch --autotuning tune|run``: tune, report, write the optimal config, and with
    ``run`` train with it. Exit status: 0, 1 when no experiment succeeded (or the training failed
    with its status), 2 for a request that cannot be carried out."""
    from dsplug.config import ConfigError

    stream = stream or sys.stdout
    for flag in ("print_only", "elastic_training"):
        if getattr(args, flag, False):
            print(f"dsplug launch --autotuning: error: --{flag} cannot be combined with --autotuning "
                  f"(tuning runs real experiments at a fixed world size)", file=sys.stderr)
            return 2
    try:
        tuner = Autotuner(args, active_resources, stream=stream)
        best = tuner.tune()
    except (AutotuningError, ConfigError) as exc:
        print(f"dsplug launch --autotuning: error: {exc}", file=sys.stderr)
        return 2
    tuner.print_tuning_results()
    if best is None:
        print(f"dsplug launch --autotuning: no experiment completed; see {tuner._rel(tuner.results_dir)}",
              file=sys.stderr)
        return 1
    tuner.write_optimal_config()
    if getattr(args, "autotuning", "") == "run":
        return tuner.run_after_tuning()
    return 0


def load_summary(results_dir: str) -> Optional[Dict[str, Any]]:
    """The ``summary.json`` of a finished tuning (None when absent)."""
    return read_json(os.path.join(results_dir, "summary.json"))


__all__ = ["Autotuner", "run_autotuning", "load_summary", "PROFILE_RUN"]
