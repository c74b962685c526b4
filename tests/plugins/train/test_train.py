"""`dsplug train`: real short runs in subprocesses (loss, files, --resume, --nproc, bad config)
and the job's parts (corpus, data order replay, model causality, config preparation, progress)."""
from __future__ import annotations

import csv
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dsplug.cli import build_parser
from dsplug.cli import main as cli_main
from dsplug.logging import logger as dsplug_logger
from dsplug.plugins.train import corpus_gen
from dsplug.plugins.train.data import CharVocab, CharWindows, batches_from, read_builtin_corpus, split_tokens
from dsplug.plugins.train.job_config import auto_warmup_steps, prepare_config
from dsplug.plugins.train.loop import main as train_main
from dsplug.plugins.train.model import CharTransformer, ModelConfig
from dsplug.plugins.train.options import worker_argv
from dsplug.plugins.train.progress import ProgressBar
from tests.conftest import free_port, scaled

TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--sample-chars", "20"]
LOSS_CSV = "Train_Samples_train_loss.csv"
# A schedule that does not depend on --steps (constant after 2 warm-up steps), so a run of 6
# steps resumed to 9 must match a run of 9 steps exactly.
STEP_INDEPENDENT_CONFIG = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_clipping": 1.0,
    "steps_per_print": 2,
    "seed": 7,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.006, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.006,
                                                 "warmup_num_steps": 2, "warmup_type": "linear"}},
    "csv_monitor": {"enabled": True, "output_path": "", "job_name": "csv_monitor"},
}


def run_train(*args, cwd, timeout=240):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run([sys.executable, "-m", "dsplug.cli", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=scaled(timeout))


def printed_path(stdout: str, label: str) -> Path:
    match = re.search(rf"^{label}: (\S+)", stdout, re.MULTILINE)
    assert match, f"no '{label}:' line in:\n{stdout}"
    return Path(match.group(1))


def loss_rows(csv_dir: Path):
    with open(csv_dir / LOSS_CSV, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"]
    return [(int(samples), float(loss)) for samples, loss in rows[1:]]


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


# ------------------------------------------------------------------------------ real runs
@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """6 steps (checkpoints at 3 and 6), then ``--resume --steps 9``; and 9 steps in one go."""
    root = tmp_path_factory.mktemp("train")
    config = root / "config.json"
    config.write_text(json.dumps(STEP_INDEPENDENT_CONFIG))
    out = root / "run"
    first = run_train(str(config), "--steps", "6", "--save-interval", "3", "--output-dir", str(out), *TINY, cwd=root)
    resumed = run_train(str(config), "--resume", "--steps", "9", "--output-dir", str(out), "--sample-chars", "20",
                        cwd=root)
    straight = run_train(str(config), "--steps", "9", "--save-interval", "3", "--output-dir", str(root / "straight"),
                         *TINY, cwd=root)
    return out, first, resumed, straight


def test_short_run_learns_and_writes_where_it_says(resumed_run):
    out, first, _, _ = resumed_run
    stdout = ok(first)
    assert "training steps 1..6" in stdout
    # one progress line per steps_per_print (2) interval, the lr rounded; the engine's own line is silenced
    progress = [line for line in stdout.splitlines() if re.match(r"(train: |\[dsplug\] )step[ =]\d", line)]
    assert [re.match(r"train: step (\d)/6  loss \d\.\d{4}  lr \d\.\d\de-\d\d  ", line).group(1)
            for line in progress] == ["2", "4", "6"], stdout
    checkpoints = printed_path(stdout, "checkpoints")
    csv_dir = printed_path(stdout, "csv_monitor")
    assert checkpoints == out / "checkpoints" and csv_dir == out / "csv_monitor"
    assert (checkpoints / "global_step3" / "mp_rank_00_model_states.pt").is_file()
    assert (checkpoints / "global_step6" / "mp_rank_00_model_states.pt").is_file()
    batch = json.loads((out / "ds_config.json").read_text())["train_batch_size"]
    rows = loss_rows(csv_dir)
    # the 6-step log as written by the first run (the resumed run appended to the same file)
    assert [s for s, _ in rows[:6]] == [batch * k for k in range(1, 7)]
    assert rows[5][1] < rows[0][1] - 0.1, f"loss did not fall: {rows[:6]}"
    final = re.search(r"^loss: ([\d.]+) at step 1 -> ([\d.]+) at step 6", stdout, re.MULTILINE)
    assert final and float(final.group(1)) == pytest.approx(rows[0][1], abs=1e-4)
    assert float(final.group(2)) == pytest.approx(rows[5][1], abs=1e-4)
    assert re.search(r"^sample \(greedy, 20 characters after 'The '\):\nThe .{20}$", stdout, re.MULTILINE | re.DOTALL)


def test_resume_continues_step_counter_schedule_and_data_order(resumed_run):
    out, first, resumed, straight = resumed_run
    ok(first)
    stdout = ok(resumed)
    assert "resumed from" in stdout and "global_step6 at step 6" in stdout
    assert "training steps 7..9" in stdout and "training steps 1.." not in stdout
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step9"
    batch = json.loads((out / "ds_config.json").read_text())["train_batch_size"]
    rows = loss_rows(out / "csv_monitor")
    assert [s for s, _ in rows] == [batch * k for k in range(1, 10)]  # 7, 8, 9 appended after 1..6
    # an uninterrupted 9-step run saw the same batches with the same weights, lr and RNG
    reference = loss_rows(Path(printed_path(ok(straight), "csv_monitor")))
    assert [s for s, _ in reference] == [s for s, _ in rows]
    assert [l for _, l in rows] == pytest.approx([l for _, l in reference], rel=1e-5)
    with open(out / "csv_monitor" / "Train_Samples_lr.csv", newline="") as f:
        lrs = [float(r[1]) for r in list(csv.reader(f))[1:]]
    with open(Path(printed_path(straight.stdout, "csv_monitor")) / "Train_Samples_lr.csv", newline="") as f:
        reference_lrs = [float(r[1]) for r in list(csv.reader(f))[1:]]
    assert lrs[6:] == pytest.approx(reference_lrs[6:])


def test_bad_config_lists_every_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4,
        "optimizr": {"type": "AdamW"},
        "gradient_clipping": -1,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "fast"}},
    }))
    assert cli_main(["train", str(bad), "--output-dir", str(tmp_path / "out"), *TINY]) != 0
    err = capsys.readouterr().err
    assert f"{bad}: 3 errors" in err
    assert "optimizr" in err and "did you mean 'optimizer'" in err
    assert "gradient_clipping: -1" in err and "scheduler.params.warmup_max_lr" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes(tmp_path):
    out = tmp_path / "run"
    stdout = ok(run_train("--nproc", "2", "--steps", "4", "--save-interval", "4", "--output-dir", str(out), *TINY,
                          cwd=tmp_path))
    assert "2 processes" in stdout and stdout.count("training steps 1..4") == 1  # rank 0 only
    tag = out / "checkpoints" / "global_step4"
    for rank in (0, 1):
        assert (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").is_file()
        assert (tag / f"rng_state_rank_{rank}.pt").is_file()
    config = json.loads((out / "ds_config.json").read_text())  # the built-in config
    assert config["optimizer"]["type"] == "AdamW" and config["scheduler"]["type"] == "WarmupCosineLR"
    assert config["train_batch_size"] == 2 * config["train_micro_batch_size_per_gpu"]
    assert list(printed_path(stdout, "tensorboard").glob("events.out.tfevents.*"))
    assert [s for s, _ in loss_rows(out / "csv_monitor")] == [config["train_batch_size"] * k for k in range(1, 5)]


# ------------------------------------------------------------------------------ Ctrl-C
def interrupted_run(*args, cwd, after_step=3, timeout=300, command=("train",)):
    """Start ``dsplug train ARGS`` (``dsplug COMMAND ARGS``) in its own session, send SIGINT to the
    whole process group (as a terminal's Ctrl-C does) once the progress shows ``after_step``;
    returns (returncode, stdout, stderr)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.Popen([sys.executable, "-m", "dsplug.cli", *command, *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            match = re.search(r"step (\d+)/", line)
            if match and int(match.group(1)) >= after_step:
                os.killpg(proc.pid, signal.SIGINT)
                break
        out, err = proc.communicate(timeout=scaled(timeout))
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc.returncode, "".join(seen) + out, err


def resume_line(stderr: str):
    match = re.search(r"^resume this run with:\n  (dsplug train .*)$", stderr, re.MULTILINE)
    assert match, stderr
    return match.group(1)


def check_interrupted(code, stdout, stderr, out: Path, config: Path, nproc: int = 1) -> int:
    """The run stopped with 130 after a step >= 3, saved that step and printed the resume line; returns the step."""
    assert code == 130, f"exit {code}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    assert "Ctrl-C: stopping after this step to save a checkpoint" in stderr
    match = re.search(r"^dsplug train: interrupted at step (\d+) of 1000 .*; checkpoint: (\S+)$", stderr, re.MULTILINE)
    assert match, stderr
    step = int(match.group(1))
    assert 3 <= step < 1000
    tag = out / "checkpoints" / f"global_step{step}"
    assert Path(match.group(2)) == tag and (out / "checkpoints" / "latest").read_text().strip() == tag.name
    for rank in range(nproc):
        assert (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [tag.name, "latest"]
    words = shlex.split(resume_line(stderr))
    expected = ["dsplug", "train", str(config)] + (["--nproc", str(nproc)] if nproc > 1 else []) + \
        ["--output-dir", str(out), "--steps", "1000", "--save-interval", "500", "--seq-len", "32", "--d-model", "32",
         "--layers", "1", "--heads", "2", "--sample-chars", "0", "--resume"]
    assert words == expected, (words, expected)
    assert "held-out loss" not in stdout and "Traceback" not in stderr
    return step


CTRL_C_CONFIG = dict(STEP_INDEPENDENT_CONFIG, steps_per_print=1, train_micro_batch_size_per_gpu=8)


def test_ctrl_c_saves_the_current_step_and_prints_the_resume_command(tmp_path):
    config = tmp_path / "my config.json"  # a space: the printed command must quote it
    config.write_text(json.dumps(CTRL_C_CONFIG))
    out = tmp_path / "run"
    code, stdout, stderr = interrupted_run(str(config), "--steps", "1000", "--save-interval", "500",
                                           "--output-dir", str(out), *TINY[:-2], "--sample-chars", "0", cwd=tmp_path)
    step = check_interrupted(code, stdout, stderr, out, config)
    # the printed command continues the run from that checkpoint (here only 2 more steps)
    words = shlex.split(resume_line(stderr))
    resumed = run_train(*words[2:], "--steps", str(step + 2), cwd=tmp_path)
    text = ok(resumed)
    assert f"global_step{step} at step {step}" in text and f"training steps {step + 1}..{step + 2}" in text
    assert (out / "checkpoints" / "latest").read_text().strip() == f"global_step{step + 2}"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_with_two_processes_saves_every_rank_at_the_same_step(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CTRL_C_CONFIG))
    out = tmp_path / "run"
    code, stdout, stderr = interrupted_run(str(config), "--nproc", "2", "--steps", "1000", "--save-interval", "500",
                                           "--output-dir", str(out), *TINY[:-2], "--sample-chars", "0", cwd=tmp_path)
    step = check_interrupted(code, stdout, stderr, out, config, nproc=2)
    assert stderr.count("interrupted at step") == 1  # rank 0 reports
    words = shlex.split(resume_line(stderr))
    text = ok(run_train(*words[2:], "--steps", str(step + 1), cwd=tmp_path))
    assert "2 processes" in text and f"global_step{step} at step {step}" in text


def _module_state(tag: Path) -> dict:
    return torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)["module"]


def _loss_text(csv_dir: Path) -> list:
    return (csv_dir / LOSS_CSV).read_text().splitlines()


def _assert_bit_identical(resumed_out: Path, straight_out: Path, step: int) -> None:
    """The interrupted-and-resumed run and the uninterrupted one end with the same weights, bit
    for bit, and logged the same losses (as written)."""
    tag = f"global_step{step}"
    got, want = _module_state(resumed_out / "checkpoints" / tag), _module_state(straight_out / "checkpoints" / tag)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    assert _loss_text(resumed_out / "csv_monitor") == _loss_text(straight_out / "csv_monitor")


def test_ctrl_c_then_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CTRL_C_CONFIG))
    out = tmp_path / "run"
    code, stdout, stderr = interrupted_run(str(config), "--steps", "1000", "--save-interval", "500",
                                           "--output-dir", str(out), *TINY[:-2], "--sample-chars", "0", cwd=tmp_path)
    step = check_interrupted(code, stdout, stderr, out, config)
    words = shlex.split(resume_line(stderr))
    ok(run_train(*words[2:], "--steps", str(step + 2), cwd=tmp_path))
    straight = tmp_path / "straight"
    ok(run_train(str(config), "--steps", str(step + 2), "--save-interval", "500", "--output-dir", str(straight),
                 *TINY[:-2], "--sample-chars", "0", cwd=tmp_path))
    _assert_bit_identical(out, straight, step + 2)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_under_dsplug_launch_saves_prints_the_resume_command_and_resumes_bit_identically(tmp_path):
    """`dsplug launch --num_procs 2 --module dsplug.plugins.train ...`: the launcher passes the
    Ctrl-C on, both ranks save the same step, the launcher exits 130; the printed command resumes
    to the weights of an uninterrupted 2-process run."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CTRL_C_CONFIG))
    out = tmp_path / "run"
    code, stdout, stderr = interrupted_run(
        "--num_procs", "2", "--master_port", str(free_port()), "--module", "dsplug.plugins.train", str(config),
        "--steps", "1000", "--save-interval", "500", "--output-dir", str(out), *TINY[:-2], "--sample-chars", "0",
        cwd=tmp_path, command=("launch",))
    step = check_interrupted(code, stdout, stderr, out, config, nproc=2)
    assert "dsplug launch: got SIGINT: passed it on to the workers" in stderr
    words = shlex.split(resume_line(stderr))
    ok(run_train(*words[2:], "--steps", str(step + 1), cwd=tmp_path))
    straight = tmp_path / "straight"
    ok(run_train(str(config), "--nproc", "2", "--steps", str(step + 1), "--save-interval", "500", "--output-dir",
                 str(straight), *TINY[:-2], "--sample-chars", "0", cwd=tmp_path))
    _assert_bit_identical(out, straight, step + 1)


def test_a_second_ctrl_c_aborts_without_saving(tmp_path):
    """The second SIGINT, while the step the first one let finish is still running (a model big
    enough for a step to take a while), quits at once: exit 130, no checkpoint for that step."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CTRL_C_CONFIG))
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.Popen([sys.executable, "-m", "dsplug.cli", "train", str(config), "--steps", "1000",
                             "--save-interval", "500", "--output-dir", str(out), "--d-model", "512", "--layers", "6",
                             "--heads", "8", "--seq-len", "128", "--sample-chars", "0"], cwd=tmp_path, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        for line in proc.stdout:
            if re.search(r"step 1/", line):
                break
        os.killpg(proc.pid, signal.SIGINT)
        for line in proc.stderr:
            if "Ctrl-C: stopping after this step" in line:
                break
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=scaled(120))
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    assert proc.returncode == 130, err
    assert "stopped by Ctrl-C; no checkpoint was saved for the step in progress" in err, err
    assert "resume this run with" not in err and "Traceback" not in err
    checkpoints = out / "checkpoints"
    assert not checkpoints.exists() or not [p for p in checkpoints.iterdir() if p.name != "latest"], \
        sorted(p.name for p in checkpoints.iterdir())


def test_interrupt_flag_then_abort_on_the_second_sigint():
    from dsplug.plugins.train.interrupt import Interrupt

    before = signal.getsignal(signal.SIGINT)
    stop = Interrupt(announce=False).install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the Python-level handler runs between bytecodes
        assert stop.requested and stop.agreed(type("E", (), {"world_size": 1})())
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGINT) is before


def test_resume_command_quotes_and_keeps_the_options(tmp_path):
    from dsplug.plugins.train.options import resume_command

    args = parse("cfg dir/c.json", "--nproc", "2", "--seed", "5", "--layers", "3", "--threads", "1",
                 "--save-interval", "7", "--text", "it's.txt", "--master-port", "29999")
    line = resume_command(args, "/runs/a b", 40, 2)
    assert shlex.split(line) == ["dsplug", "train", os.path.abspath("cfg dir/c.json"), "--nproc", "2",
                                 "--output-dir", "/runs/a b", "--steps", "40", "--save-interval", "7", "--seed", "5",
                                 "--layers", "3", "--threads", "1", "--text", os.path.abspath("it's.txt"),
                                 "--master-port", "29999", "--resume"]
    # a worker sees the parent's options through worker_argv (and --nproc as WORLD_SIZE)
    worker = parse(*worker_argv(args, "/runs/a b", 40))
    assert resume_command(worker, "/runs/a b", 40, 2) == line


# ------------------------------------------------------------------------------ refusals (in process)
def parse(*argv):
    return build_parser().parse_args(["train", *argv])


def test_resume_without_checkpoint_is_refused(tmp_path, capsys):
    assert train_main(parse("--resume", "--output-dir", str(tmp_path))) == 2
    assert f"no checkpoint in {tmp_path / 'checkpoints'}" in capsys.readouterr().err


def test_existing_run_needs_resume_and_keeps_its_model(resumed_run, capsys):
    out, first, _, _ = resumed_run
    ok(first)
    assert train_main(parse("--output-dir", str(out))) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert train_main(parse("--resume", "--output-dir", str(out), "--d-model", "64")) == 2
    assert "--d-model 64 differs from the checkpoint's 32" in capsys.readouterr().err


def test_worker_argv_reparses_to_the_same_settings():
    args = parse("cfg.json", "--nproc", "2", "--resume", "--seed", "5", "--layers", "3", "--threads", "1")
    again = parse(*worker_argv(args, "/abs/out", 77))
    assert (again.config, again.nproc, again.output_dir, again.steps, again.resume, again.seed, again.n_layers,
            again.d_model, again.threads) == ("cfg.json", 1, "/abs/out", 77, True, 5, 3, None, 1)


# ------------------------------------------------------------------------------ parts
def test_shipped_corpus_is_the_generators_output():
    assert read_builtin_corpus() == corpus_gen.generate()


def test_vocab_round_trip_and_unknown_characters():
    vocab = CharVocab.of_text("hello world")
    assert vocab.decode(vocab.encode("low roll")) == "low roll"
    with pytest.raises(ValueError, match=r"not in the vocabulary: 'xz'"):
        vocab.encode("zox")


def test_windows_are_shifted_pairs_and_split_holds_out_the_tail():
    tokens = torch.arange(100)
    train, held = split_tokens(tokens, seq_len=8, held_out_fraction=0.2)
    assert torch.equal(torch.cat([train, held]), tokens) and len(held) == 20
    windows = CharWindows(train, 8)
    assert len(windows) == 80 - 8
    x, y = windows[5]
    assert x.tolist() == list(range(5, 13)) and y.tolist() == list(range(6, 14))
    with pytest.raises(ValueError, match="too few"):
        CharWindows(torch.arange(8), 8)


def test_batches_from_replays_the_loader_order_across_epochs():
    from dsplug.dataloader import build_dataloader

    dataset = CharWindows(torch.arange(40), 4)  # 36 windows -> 9 batches of 4 per epoch
    loader = build_dataloader(dataset, 4, world_size=1, rank=0, seed=3)
    reference = []
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        reference += [batch[0] for batch in loader]
    assert not torch.equal(reference[0], reference[9])  # epochs are shuffled differently
    for start in (0, 4, 9, 13):
        replay = batches_from(loader, start)
        for expected in reference[start:start + 12]:
            assert torch.equal(next(replay)[0], expected)


def test_model_is_causal_and_ties_the_output_to_the_embedding():
    torch.manual_seed(0)
    model = CharTransformer(ModelConfig(vocab_size=11, seq_len=16, d_model=16, n_layers=2, n_heads=2)).eval()
    assert model.head.weight is model.token_embedding.weight
    tokens = torch.randint(0, 11, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 11
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 16, 11)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)  # the past does not see the future
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    with pytest.raises(ValueError, match="longer than the model's seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(vocab_size=11, d_model=10, n_heads=4)


def test_prepare_config_fills_steps_seed_and_monitor_paths(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2,
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}},
        "csv_monitor": {"enabled": True, "output_path": "logs", "job_name": "j"},
        "tensorboard": {"enabled": True, "output_path": str(tmp_path / "elsewhere")},
    }))
    raw, where, notes = prepare_config(str(config), steps=50, output_dir="/runs/a", seed=9)
    assert where == str(config) and notes == []
    assert raw["scheduler"]["params"] == {"total_num_steps": 50, "warmup_num_steps": auto_warmup_steps(50)}
    assert auto_warmup_steps(50) == 5 and auto_warmup_steps(3) == 2 and auto_warmup_steps(1) == 1
    assert raw["seed"] == 9
    assert raw["csv_monitor"]["output_path"] == "/runs/a/logs"
    assert raw["tensorboard"]["output_path"] == str(tmp_path / "elsewhere")  # absolute: kept
    builtin, _, _ = prepare_config(None, steps=10, output_dir="/runs/b", seed=None)
    assert builtin["optimizer"]["type"] == "AdamW" and builtin["csv_monitor"]["output_path"] == "/runs/b"


def test_progress_plain_lines_every_n_steps():
    stream = io.StringIO()
    bar = ProgressBar(first=1, last=5, tokens_per_step=100, every=2, stream=stream, interactive=False)
    for step in range(1, 6):
        bar.update(step, loss=5.0 - step, lr=1e-3)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert [re.search(r"step (\d+)/5", line).group(1) for line in lines] == ["2", "4", "5"]
    assert "loss 3.0000" in lines[0] and "lr 1.00e-03" in lines[0] and "tok/s" in lines[0]


def test_progress_silences_the_engines_step_line_while_open(capsys):
    from dsplug.logging import step_logger

    bar = ProgressBar(first=1, last=2, tokens_per_step=1, stream=io.StringIO(), interactive=False)
    step_logger.info("[dsplug] step=1, lr=[0.001]")
    dsplug_logger.info("a warning")
    bar.close()
    step_logger.info("[dsplug] step=2, lr=[0.001]")
    assert capsys.readouterr().out.splitlines() == ["a warning", "[dsplug] step=2, lr=[0.001]"]


def test_progress_on_a_terminal_redraws_one_line_and_clears_it_for_log_messages():
    stream = io.StringIO()
    bar = ProgressBar(first=1, last=3, tokens_per_step=10, stream=stream, interactive=True)
    bar.update(1, loss=2.0, lr=0.1)
    assert stream.getvalue().startswith("\r\033[K[") and "\n" not in stream.getvalue()
    dsplug_logger.info("a message")
    assert stream.getvalue().endswith("\r\033[K")  # cleared before the record was printed
    bar.update(3, loss=1.0, lr=0.1)
    bar.close()
    assert stream.getvalue().endswith("\n") and "step 3/3" in stream.getvalue()
    assert not dsplug_logger.filters


def test_resume_without_output_dir_picks_the_newest_run(tmp_path, monkeypatch):
    import datetime

    from dsplug.plugins.train.loop import default_output_dir, newest_resumable_run

    monkeypatch.chdir(tmp_path)
    assert newest_resumable_run() is None
    for name, mtime in (("run-a", 100), ("run-b", 300), ("run-c", 200)):
        latest = tmp_path / "dsplug_runs" / name / "checkpoints" / "latest"
        latest.parent.mkdir(parents=True)
        latest.write_text("global_step1")
        os.utime(latest, (mtime, mtime))
    (tmp_path / "dsplug_runs" / "run-d").mkdir()  # newer, but nothing to resume
    assert newest_resumable_run() == str(tmp_path / "dsplug_runs" / "run-b")
    now = datetime.datetime(2030, 1, 2, 3, 4, 5)
    first = default_output_dir(now=now)
    assert first == str(tmp_path / "dsplug_runs" / "run-20300102-030405")
    os.makedirs(first)
    assert default_output_dir(now=now) == first + "-2"
