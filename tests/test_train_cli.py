"""train.py end to end on a real Multi30k slice: workdir contents, exact resume, damaged
checkpoints, config mismatch, non-finite loss, SIGTERM, --help and bad flags.

Most runs call `train.main` in this process so that they share one compiled
train step (same tiny model, same recipe, one batch shape); the SIGTERM,
--help and bad-flag tests run train.py as a subprocess.
"""

import argparse
import dataclasses
import errno
import hashlib
import json
import math
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import train
from transformer import training
from transformer.checkpoints import (
    CheckpointError,
    Checkpoints,
    average_params,
    checkpoint_steps,
    load_run_config,
    restore_last,
    restore_params,
    save_run_config,
)
from transformer.training import NonFiniteLossError, read_metrics

ROOT = Path(__file__).resolve().parents[1]


def _flags(slice_dir, workdir, *extra):
    return [
        "--workdir", str(workdir),
        "--dataset", "files", "--data-dir", str(slice_dir),
        "--preset", "tiny", "--vocab-size", "400", "--max-len", "64",
        "--max-tokens", "1024", "--max-shapes", "1",
        "--warmup-steps", "10", "--lr-scale", "0.5", "--cooldown", "0",
        "--log-every", "4", "--checkpoint-every", "4", "--keep-checkpoints", "3",
        "--eval-every", "0", "--bleu-every", "0", "--no-progress",
        *extra,
    ]  # fmt: skip


def _parse(*argv):
    """train.py's flags as it parses them (argv items may be paths)."""
    return train.build_parser().parse_args([str(a) for a in argv])


def _sigterm_after_step(step, monkeypatch):
    """Sends this process a SIGTERM once training reaches `step` (before its logging and
    saving), as a scheduler would."""
    after_step = training.Trainer._after_step

    def signalled(self, *args, **kwargs):
        if self.step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return after_step(self, *args, **kwargs)

    monkeypatch.setattr(training.Trainer, "_after_step", signalled)


def _params_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def straight_run(slice_dir, tmp_path_factory):
    """16 steps without stopping, with validation loss at 8 and 16 and BLEU at 16."""
    workdir = tmp_path_factory.mktemp("straight")
    extra = ["--steps", "16", "--eval-every", "8", "--bleu-every", "16"]
    extra += ["--bleu-max-sentences", "8"]
    assert train.main(_flags(slice_dir, workdir, *extra)) == 0
    return workdir


def test_workdir_has_everything_evaluation_needs_and_loss_falls(straight_run, capsys):
    workdir = straight_run
    config = load_run_config(workdir)
    assert config["model"]["d_model"] == 32 and config["model"]["vocab_size"] == 400
    assert config["data"]["dataset"] == "files" and config["data"]["max_len"] == 64
    assert config["train"]["steps"] == 16 and config["train"]["warmup_steps"] == 10
    # What else decides the numbers: the software it ran with.
    [environment] = config["environments"]
    assert environment["step"] == 0
    assert environment["packages"]["jax"] == jax.__version__
    assert environment["devices"] == f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    assert (workdir / "tokenizer.model").is_file()
    assert list(workdir.glob("events.out.tfevents.*"))
    assert checkpoint_steps(workdir) == [8, 12, 16]  # last 3 (16 is also the best)
    records = read_metrics(workdir)
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [4, 8, 12, 16]
    for r in train_records:
        assert {"loss", "lr", "tokens_per_s"} <= set(r) and r["tokens_per_s"] > 0
    assert train_records[-1]["loss"] < train_records[0]["loss"] - 0.3
    elapsed = [r["elapsed_s"] for r in records]
    assert elapsed[0] > 0 and elapsed == sorted(elapsed)  # training time, for curves
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [8, 16] and "val_bleu" in val[-1]
    assert val[1]["val_loss"] < val[0]["val_loss"]
    _, best_step = restore_params(workdir, "best")
    assert best_step == 16


def test_the_checkpoint_with_the_best_validation_bleu_is_kept_and_restored(
    slice_dir, tmp_path, capsys, monkeypatch
):
    scores = iter([5.0, 1.0, 2.0, 3.0])  # validation BLEU at steps 3, 6, 9 and 12
    monkeypatch.setattr(training, "evaluate_bleu", lambda *args, **kwargs: next(scores))
    workdir = tmp_path / "run"
    # A scored step is saved off the --checkpoint-every 4 schedule, or the best is lost.
    extra = ["--steps", "12", "--bleu-every", "3", "--keep-checkpoints", "1"]
    assert train.main(_flags(slice_dir, workdir, *extra)) == 0
    assert checkpoint_steps(workdir) == [3, 12]  # the last, and the best besides it
    assert restore_params(workdir, "best")[1] == 3
    assert [r["val_bleu"] for r in read_metrics(workdir) if "val_bleu" in r] == [5, 1, 2, 3]
    out, err = capsys.readouterr()
    assert "best validation BLEU 5.00 at step 3" in out + err


def test_resuming_with_more_steps_moves_the_cooldown_to_the_new_end(slice_dir, tmp_path):
    flags = _flags(slice_dir, tmp_path / "run", "--cooldown", "0.5")
    assert train.main([*flags, "--steps", "8"]) == 0
    assert train.main([*flags, "--steps", "16"]) == 0
    logged = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "run") if "lr" in r}
    paper = training.learning_rate_schedule(32, warmup_steps=10, scale=0.5)  # tiny: d_model 32
    # The cooldown is the last half: of 8 steps in the first run, of 16 after the resume.
    factor = {4: 1.0, 8: 1 / 4, 12: 5 / 8, 16: 1 / 8}
    assert sorted(logged) == sorted(factor)
    for step, lr in logged.items():
        assert lr == pytest.approx(float(paper(step - 1)) * factor[step], rel=1e-5)


def test_a_full_disk_while_training_exits_1_with_one_line(slice_dir, tmp_path, capsys, monkeypatch):
    # Not bad input (2): the same command resumes once there is room.
    import orbax.checkpoint as ocp

    def full(*args, **kwargs):
        raise ValueError("RESOURCE_EXHAUSTED: Error writing: No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "save", full)
    assert train.main(_flags(slice_dir, tmp_path / "run", "--steps", "4")) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write a checkpoint in ") and err.count("\n") == 1
    assert "no space left on device" in err


# A checkpoint folder that cannot be made (permissions, which root passes by, so made here).
UNWRITABLE_CHECKPOINTS = (
    "import os; real = os.mkdir\n"
    "def mkdir(path, *args, **kwargs):\n"
    "    if 'orbax-checkpoint-tmp' in str(path):\n"
    "        raise PermissionError(13, 'Permission denied', str(path))\n"
    "    return real(path, *args, **kwargs)\n"
    "os.mkdir = mkdir\n"
    "import train; from transformer.compilation_cache import exit_process; exit_process(train.main)"
)


def test_a_failed_checkpoint_write_ends_the_process_with_one_line(slice_dir, tmp_path):
    # Orbax leaves the rest of a failed save unstarted: on 2 devices its threads waited
    # for it forever, so the process never exited, and on 1 Python printed 8 lines at exit
    # ("coroutine '_create_paths' was never awaited", ...).
    flags = _flags(slice_dir, tmp_path, "--steps", "8")
    done = subprocess.run(
        [sys.executable, "-c", UNWRITABLE_CHECKPOINTS, *flags], env=_two_cpu_devices_env(),
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.startswith("error: cannot write a checkpoint in ") and "Permission" in (
        done.stderr
    )
    assert done.stderr.count("\n") == 1, done.stderr


def _without(flags: list[str], flag: str) -> list[str]:
    return [f for f in flags if f != flag]


def test_without_a_progress_bar_each_log_step_prints_its_loss(slice_dir, tmp_path, capsys):
    # --no-progress, and by default where stderr is not a terminal (here pytest's capture):
    # a log file got the bar's redrawing and no step lines.
    flags = _without(_flags(slice_dir, tmp_path / "run", "--steps", "8"), "--no-progress")
    assert train.main(flags) == 0
    out, err = capsys.readouterr()
    assert "\r" not in err
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    logged = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [line.split(":")[0] for line in lines] == ["step 4/8", "step 8/8"]
    for line, record in zip(lines, logged, strict=True):
        assert f"loss {record['loss']:.3f}, lr {record['lr']:.2e}, " in line


def test_at_a_terminal_the_progress_bar_shows_the_loss_unless_no_progress(
    slice_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # pytest's capture, as a terminal
    monkeypatch.setattr(sys.stderr, "fileno", lambda: 2)  # for the hang-up handler
    flags = _flags(slice_dir, tmp_path / "run", "--steps", "8")
    assert train.main(_without(flags, "--no-progress")) == 0
    out, err = capsys.readouterr()
    assert "\r" in err and "loss=" in err and "8/8" in err
    assert not [line for line in out.splitlines() if line.startswith("step ")]
    assert train.main([*flags, "--steps", "12"]) == 0  # --no-progress: the lines
    out, err = capsys.readouterr()
    assert "step 12/12: loss " in out and "loss=" not in err


def test_a_run_on_the_cpu_where_an_accelerator_was_expected_says_so(
    slice_dir, tmp_path, capsys, monkeypatch
):
    # A CUDA plugin and device found, but JAX on the CPU (a broken driver, say):
    # keep_freed_host_memory left the CPU step's malloc settings off, silently.
    from transformer import host_memory

    monkeypatch.setattr(host_memory, "accelerator_expected", lambda: True)
    assert train.main(_flags(slice_dir, tmp_path / "run", "--steps", "1")) == 0
    out = capsys.readouterr().out
    assert "warning: JAX runs on the CPU although a GPU or TPU plugin and device" in out
    assert "set JAX_PLATFORMS=cpu" in out
    monkeypatch.setattr(host_memory, "accelerator_expected", lambda: False)
    assert train.main(_flags(slice_dir, tmp_path / "other", "--steps", "1")) == 0
    assert "warning: JAX runs on the CPU" not in capsys.readouterr().out
    # Nor where JAX runs on the accelerator it found.
    monkeypatch.setattr(host_memory, "accelerator_expected", lambda: True)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    logged = []
    train.warn_of_cpu_fallback(logged.append)
    assert logged == []


# train.py in a subprocess that compiles its step programs side by side, as on a GPU, and
# exits as `python train.py` does.
FORCED_SIDE_BY_SIDE = (
    "import train; from transformer.compilation_cache import exit_process; "
    "train.compiles_side_by_side = lambda: True; exit_process(train.main)"
)
# The same, with every compilation 60 s slower, as one can be on a GPU: each prints
# "a compilation started", and makes the file $SLOW_COMPILED when its 60 s end.
SLOW_COMPILING = (
    "import os, time, jax; real = jax.stages.Lowered.compile\n"
    "def slow(self, *a, **k):\n"
    "    print('a compilation started', flush=True); time.sleep(60)\n"
    "    open(os.environ['SLOW_COMPILED'], 'a').close()\n"
    "    return real(self, *a, **k)\n"
    "jax.stages.Lowered.compile = slow; "
)


def _two_cpu_devices_env() -> dict[str, str]:
    """A subprocess environment with 2 CPU devices and this checkout importable."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_step_programs_compiled_side_by_side_train_exactly_as_one_by_one(slice_dir, tmp_path):
    # On a GPU or TPU train.py compiles every step program before the first step; on the
    # CPU it does not, so here that path is forced, on 2 devices with 2 batch shapes and
    # validation, and must not change a number.
    assert not train.compiles_side_by_side()
    default = "import sys, train; sys.exit(train.main())"
    extra = ["--steps", "12", "--max-shapes", "2", "--eval-every", "6"]
    runs = {}
    for name, code in (("ahead", FORCED_SIDE_BY_SIDE), ("lazy", default)):
        flags = _flags(slice_dir, tmp_path / name, *extra)
        done = subprocess.run(
            [sys.executable, "-c", code, *flags], env=_two_cpu_devices_env(), capture_output=True,
            text=True, timeout=300, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        runs[name] = done.stdout
    assert "compiling: 2 train-step and " in runs["ahead"] and "compiled: " in runs["ahead"]
    assert "compiling" not in runs["lazy"] and "2 cpu device(s)" in runs["lazy"]
    ahead, _ = restore_params(tmp_path / "ahead", "last")
    lazy, _ = restore_params(tmp_path / "lazy", "last")
    _params_equal(ahead, lazy)

    assert _timeless_metrics(tmp_path / "ahead") == _timeless_metrics(tmp_path / "lazy")
    assert any("val_loss" in r for r in _timeless_metrics(tmp_path / "lazy"))
    # The run's clock counts the compiling, as it does when each program comes with its step.
    seconds = float(runs["ahead"].split("compiled: ")[1].split(" programs in ")[1].split(" s")[0])
    assert read_metrics(tmp_path / "ahead")[0]["elapsed_s"] >= seconds
    # And so does the time on the "done" line (it left the compiling out).
    done = runs["ahead"].split("done: step 12 of 12 in ")[1][:8]
    hours, minutes, secs = (int(part) for part in done.split(":"))
    last_record = read_metrics(tmp_path / "ahead")[-1]
    assert hours * 3600 + minutes * 60 + secs >= int(last_record["elapsed_s"])


def test_validation_programs_are_compiled_ahead_only_when_a_validation_is_due():
    config = training.TrainConfig(steps=10**6, eval_every=1000, bleu_every=5000)
    assert not train.validates_between(config, 0, 999)
    assert train.validates_between(config, 0, 1000)
    assert not train.validates_between(config, 1000, 1999)  # resumed after the one at 1000
    assert train.validates_between(dataclasses.replace(config, eval_every=0), 4000, 5000)
    assert not train.validates_between(
        dataclasses.replace(config, eval_every=0, bleu_every=0), 0, 10**6
    )
    # And compile_step_programs asks for the validation's programs by that rule.
    assert _compiled_ahead(config, start=0, total_steps=999)[0] == [[TRAIN_LAYOUT], []]
    assert _compiled_ahead(config, start=0, total_steps=1000)[0] == [[TRAIN_LAYOUT], [VAL_LAYOUT]]


# A batch's src, tgt_in and tgt_out shapes, [devices, rows, length] (batch_layout).
TRAIN_LAYOUT = ((1, 8, 5), (1, 8, 6), (1, 8, 6))
VAL_LAYOUT = ((1, 8, 7), (1, 8, 9), (1, 8, 9))


def _compiled_ahead(config, *, start, total_steps):
    """What `compile_step_programs` asks a stand-in Trainer of `config` to compile, for one
    training shape and one validation batch: [train layouts, validation layouts]; and the
    stop request it was given."""
    compiled = []

    class Trainer:
        def compile_steps(self, train_layouts, eval_layouts, *, stop):
            compiled.extend([list(train_layouts), list(eval_layouts)])
            return len(compiled[0]) + len(compiled[1])

    trainer = Trainer()
    trainer.config = config
    layouts = zip(training.BATCH_KEYS, VAL_LAYOUT, strict=True)
    batch = {name: np.zeros(shape) for name, shape in layouts}
    loaded = train.TrainingData(
        tokenizer=None,
        batcher=argparse.Namespace(array_shapes=lambda: [TRAIN_LAYOUT]),
        validation=argparse.Namespace(batches=lambda: [batch]),
        summary=[],
        cache_files=[],
    )
    stop = train.StopRequest()
    train.compile_step_programs(
        trainer, loaded, lambda line: None, start=start, total_steps=total_steps, stop=stop
    )
    return compiled, stop


def test_a_stop_once_the_programs_are_compiled_ahead_says_it_saves_a_checkpoint():
    # A stop while compiling saves nothing, and its line says so; once the compiling is
    # done the loop saves a checkpoint at a stop, and the line must say that instead.
    config = training.TrainConfig(steps=10, eval_every=0, bleu_every=0)
    _, stop = _compiled_ahead(config, start=0, total_steps=10)
    training_started = threading.Event()
    training_started.set()
    handler, logged = _stop_handler(stop, training_started)
    _signalled(handler, signal.SIGTERM)
    assert logged == [
        "SIGTERM: saving a checkpoint, then stopping (a Ctrl-C now stops at once, maybe before it)"
    ]


def _stop_handler(stop, training_started):
    """train.py's handler of the stop signals for `stop` (returned to be called, not left
    installed) and the lines it logs."""
    logged = []
    previous = train.install_stop_handlers(stop, logged.append, training_started)
    handler = signal.getsignal(signal.SIGTERM)
    for signum, previous_handler in previous.items():
        signal.signal(signum, previous_handler)
    return handler, logged


def _signalled(handler, signum):
    """Calls the stop handler as `signum` would; a KeyboardInterrupt (the run ends at once)
    fails the test instead of ending the test session."""
    try:
        handler(signum, None)
    except KeyboardInterrupt:
        pytest.fail(f"{signal.Signals(signum).name} ended the run at once")


def test_only_a_second_ctrl_c_cuts_the_save_of_a_stopped_run_short():
    # A scheduler may send SIGTERM again before it kills: the run still saves its checkpoint.
    stop, training_started = train.StopRequest(), threading.Event()
    training_started.set()
    handler, _ = _stop_handler(stop, training_started)
    _signalled(handler, signal.SIGTERM)
    _signalled(handler, signal.SIGTERM)
    assert stop.is_set() and stop.signum == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, None)


def test_the_first_stop_signal_before_training_gives_the_exit_status():
    # Ctrl-C, then a scheduler's SIGTERM, while the data loads: 130, as for the Ctrl-C alone.
    stop = train.StopRequest()
    handler, _ = _stop_handler(stop, threading.Event())
    _signalled(handler, signal.SIGINT)
    _signalled(handler, signal.SIGTERM)
    with pytest.raises(train.PreTrainingStop) as stopped:
        train.check_stop_before_training(stop)
    assert stopped.value.signum == signal.SIGINT


def test_sigterm_while_compiling_ahead_exits_without_waiting_for_the_compilations(
    slice_dir, tmp_path
):
    # Python's exit waited for every compilation under way (half a minute each on a GPU),
    # and programs were still lowered and started after the signal.
    args = _flags(
        slice_dir, tmp_path, "--steps", "1000", "--max-shapes", "8", "--eval-every", "500"
    )
    code = SLOW_COMPILING + FORCED_SIDE_BY_SIDE
    compiled = tmp_path / "compiled"
    env = {**_two_cpu_devices_env(), "SLOW_COMPILED": str(compiled)}
    process = subprocess.Popen(
        [sys.executable, "-c", code, *args], env=env, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = []
        for line in process.stdout:  # up to the start of the first compilation
            lines.append(line)
            if line == "a compilation started\n":
                break
        assert lines[-1:] == ["a compilation started\n"], "".join(lines)
        assert any(line.startswith("compiling: ") for line in lines)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    out = "".join(lines) + out
    assert process.returncode == 0, err
    assert "SIGTERM: stopping the compiling; nothing new was trained, so nothing is saved" in out
    assert "compiling stopped: 0 of " in out and "interrupted before the first update" in out
    assert checkpoint_steps(tmp_path) == []  # no untrained checkpoint to join an average
    assert not compiled.exists()  # it ended during the compilations under way


def test_stop_and_resume_gives_exactly_the_uninterrupted_parameters(
    straight_run, slice_dir, tmp_path, capsys
):
    # Dropout is on (tiny preset: 0.1), so this also checks the RNG and data position.
    assert train.main(_flags(slice_dir, tmp_path, "--steps", "8")) == 0
    assert checkpoint_steps(tmp_path) == [4, 8]
    assert train.main(["--workdir", str(tmp_path), "--steps", "16", "--no-progress"]) == 0
    assert "resumed from step 8" in capsys.readouterr().out
    resumed, step = restore_params(tmp_path, "last")
    straight, _ = restore_params(straight_run, "last")
    assert step == 16
    _params_equal(resumed, straight)
    # The logged losses agree too, and no step is logged twice.
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path) if "loss" in r}
    expected = {r["step"]: r["loss"] for r in read_metrics(straight_run) if "loss" in r}
    assert losses == expected
    config = load_run_config(tmp_path)
    assert config["train"]["steps"] == 16
    assert [e["step"] for e in config["environments"]] == [0, 8]
    elapsed = [r["elapsed_s"] for r in read_metrics(tmp_path)]
    assert elapsed == sorted(elapsed)  # the clock carries over the resume


def test_a_run_resumes_exactly_from_its_moved_data_and_says_what_the_resume_changes(
    straight_run, slice_dir, tmp_path, capsys
):
    # The error for moved data said to pass --data-dir, which was then refused as "other
    # data settings": only editing config.json by hand resumed the run.
    data_dir, moved = tmp_path / "data", tmp_path / "moved"
    shutil.copytree(slice_dir, data_dir)
    workdir = tmp_path / "run"
    assert train.main(_flags(data_dir, workdir, "--steps", "8")) == 0
    data_dir.rename(moved)
    capsys.readouterr()
    assert train.main(["--workdir", str(workdir), "--steps", "16", "--no-progress"]) == 2
    assert f"data directory {data_dir} not found; pass --data-dir" in capsys.readouterr().err
    resume = ["--workdir", str(workdir), "--data-dir", str(moved), "--steps", "16"]
    assert train.main([*resume, "--no-progress"]) == 0
    out = capsys.readouterr().out
    changes = f"--steps 8 -> 16; --data-dir {data_dir} -> {moved}"
    assert f"resuming with settings other than the run's: {changes}\n" in out
    assert "resumed from step 8" in out
    # Its own tokenizer, not one trained again on the moved files (which another
    # sentencepiece could cut into other pieces than the checkpoint's embeddings know).
    assert sorted(p.name for p in workdir.glob("tokenizer.model*")) == ["tokenizer.model"]
    assert load_run_config(workdir)["data"]["data_dir"] == str(moved)
    _params_equal(restore_params(workdir, "last")[0], restore_params(straight_run, "last")[0])


def test_a_run_resumes_from_moved_tfds_data_as_from_moved_files(straight_run):
    saved = load_run_config(straight_run)
    tfds = {"dataset": "tfds", "data_dir": None, "tfds_name": "wmt14_translate/de-en"}
    there = {**saved["data"], **tfds, "tfds_data_dir": "/scratch/tfds"}
    now = {**there, "tfds_data_dir": "/data/tfds"}
    train.check_resume_matches(straight_run, {"data": there}, "data", now)  # taken
    resumed = train.train_config(_parse(), saved)
    changes = train.resumed_changes({**saved, "data": there}, resumed, now)
    assert changes == ["--tfds-data-dir /scratch/tfds -> /data/tfds"]


def test_a_stop_between_two_log_records_resumes_to_the_same_records_and_checkpoints(
    straight_run, slice_dir, tmp_path, capsys, monkeypatch
):
    # A record holds the means over the steps since the last one; the checkpoint of a
    # stop at step 14 carries the sums of steps 13 and 14 into the resumed run's record 16.
    _sigterm_after_step(14, monkeypatch)
    assert train.main(_flags(slice_dir, tmp_path, "--steps", "16")) == 0
    out = capsys.readouterr().out
    assert "SIGTERM: saving a checkpoint, then stopping (a Ctrl-C now stops at once" in out
    assert "interrupted at step 14" in out
    # The stop's checkpoint is not one of the last 3 the run keeps: counted among them, it
    # deleted step 8 for good, and evaluate.py's average of the last 3 took 12, 14 and 16
    # where a run that never stopped has 8, 12 and 16.
    assert checkpoint_steps(tmp_path) == [4, 8, 12, 14]
    monkeypatch.undo()
    assert train.main(["--workdir", str(tmp_path), "--no-progress"]) == 0
    fields = ("step", "loss", "nll", "grad_norm")
    logged = [tuple(r[k] for k in fields) for r in read_metrics(tmp_path) if "loss" in r]
    expected = [tuple(r[k] for k in fields) for r in read_metrics(straight_run) if "loss" in r]
    assert [r[0] for r in logged] == [4, 8, 12, 16] and logged == expected
    assert checkpoint_steps(tmp_path) == checkpoint_steps(straight_run) == [8, 12, 16]
    averaged, steps = restore_last(tmp_path, 3)
    assert steps == [8, 12, 16]
    _params_equal(average_params(averaged), average_params(restore_last(straight_run, 3)[0]))


def test_a_stop_before_the_first_update_saves_nothing_and_the_run_starts_again(
    straight_run, slice_dir, tmp_path, capsys, monkeypatch
):
    # It saved the untrained step 0, which evaluate.py's default average then took in.
    run = training.Trainer.run

    def stopped_at_once(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler sets the stop event
        return run(self, *args, **kwargs)

    monkeypatch.setattr(training.Trainer, "run", stopped_at_once)
    assert train.main(_flags(slice_dir, tmp_path, "--steps", "8")) == 0
    assert "interrupted before the first update: nothing was trained" in capsys.readouterr().out
    assert checkpoint_steps(tmp_path) == []
    monkeypatch.undo()
    assert train.main(_flags(slice_dir, tmp_path, "--steps", "8")) == 0
    assert checkpoint_steps(tmp_path) == [4, 8]
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path) if "loss" in r}
    expected = {r["step"]: r["loss"] for r in read_metrics(straight_run) if "loss" in r}
    assert losses == {step: expected[step] for step in (4, 8)}


def _timeless_metrics(workdir):
    """A run's metrics.jsonl records without their clock readings (elapsed_s, tokens_per_s)."""
    drop = ("elapsed_s", "tokens_per_s")
    return [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(workdir)]


@pytest.mark.parametrize("stop_at", [8, 16], ids=["mid-run", "last-step"])
def test_a_validation_a_stop_skipped_is_run_on_resume_as_in_a_run_never_stopped(
    stop_at, slice_dir, tmp_path, capsys, monkeypatch
):
    # A full validation can outlast the time a scheduler allows between SIGTERM and SIGKILL,
    # so a stop skips it; the resumed run never ran it: a record short, and a checkpoint
    # without the BLEU that could have made it the best.
    extra = ["--steps", "16", "--eval-every", "8", "--bleu-every", "8", "--bleu-max-sentences", "8"]
    straight = tmp_path / "straight"
    assert train.main(_flags(slice_dir, straight, *extra)) == 0
    stopped = tmp_path / "stopped"
    _sigterm_after_step(stop_at, monkeypatch)
    assert train.main(_flags(slice_dir, stopped, *extra)) == 0
    out = capsys.readouterr().out
    assert f"step {stop_at}: validation skipped: stopping" in out
    assert f"interrupted at step {stop_at}" in out
    validated = [r["step"] for r in read_metrics(stopped) if "val_loss" in r]
    assert validated == ([8] if stop_at == 16 else [])
    monkeypatch.undo()
    assert train.main(["--workdir", str(stopped), "--no-progress"]) == 0
    assert f"step {stop_at}: val_loss" in capsys.readouterr().out
    assert _timeless_metrics(stopped) == _timeless_metrics(straight)
    assert checkpoint_steps(stopped) == checkpoint_steps(straight) == [8, 12, 16]
    with Checkpoints(straight, read_only=True) as a, Checkpoints(stopped, read_only=True) as b:
        assert [b.metrics(s) for s in (8, 12, 16)] == [a.metrics(s) for s in (8, 12, 16)]
        assert a.metrics(stop_at)["val_bleu"] >= 0 and b.best_step() == a.best_step()


def test_without_workdir_a_run_goes_to_runs_corpus_src_tgt_and_resumes_from_there(
    slice_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    flags = _flags(slice_dir, "unused", "--steps", "4")[2:]  # without --workdir
    assert train.main(flags) == 0
    default = tmp_path / "runs" / f"{slice_dir.name}_en_de"
    assert f"workdir: runs/{slice_dir.name}_en_de (the default" in capsys.readouterr().out
    assert checkpoint_steps(default) == [4]
    # The same data flags again find the run and resume it; other languages, another run.
    assert train.main([*flags[:-2], "--steps", "8"]) == 0
    assert "resumed from step 4" in capsys.readouterr().out
    assert checkpoint_steps(default) == [4, 8]
    assert train.main([*flags, "--src", "de", "--tgt", "en"]) == 0
    assert checkpoint_steps(tmp_path / "runs" / f"{slice_dir.name}_de_en") == [4]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(
        [f"{slice_dir.name}_en_de", f"{slice_dir.name}_de_en"]
    )


def test_default_workdir_names_the_corpus():
    assert train.default_workdir(_parse()) == Path("runs/multi30k_en_de")
    assert train.default_workdir(_parse("--src", "de", "--tgt", "en")) == Path(
        "runs/multi30k_de_en"
    )
    files = _parse("--dataset", "files", "--data-dir", "corpora/europarl", "--src", "fr")
    assert train.default_workdir(files) == Path("runs/europarl_fr_de")
    tfds = _parse("--dataset", "tfds", "--tfds-name", "wmt14_translate/de-en:1.0.0")
    assert train.default_workdir(tfds) == Path("runs/wmt14_translate_en_de")


def test_resuming_with_other_package_versions_warns_and_goes_on(slice_dir, tmp_path, capsys):
    assert train.main(_flags(slice_dir, tmp_path, "--steps", "4")) == 0
    config = load_run_config(tmp_path)
    config["environments"][-1]["packages"]["jaxlib"] = "0.0.1"
    (tmp_path / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert train.main(["--workdir", str(tmp_path), "--steps", "8", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "warning: resuming with other software than before (jaxlib 0.0.1 -> " in out
    assert checkpoint_steps(tmp_path)[-1] == 8
    environments = load_run_config(tmp_path)["environments"]
    assert [e["step"] for e in environments] == [0, 4]
    assert environments[0]["packages"]["jaxlib"] == "0.0.1"  # the earlier record is kept


def test_a_run_started_again_before_its_first_checkpoint_has_no_software_to_warn_of(
    straight_run, slice_dir, tmp_path, capsys
):
    # Killed before its first checkpoint, a run starts again from step 0: nothing trained
    # with the other software is mixed in, so the warning would be a false alarm.
    config = load_run_config(straight_run)
    config["environments"][-1]["packages"]["jaxlib"] = "0.0.1"
    save_run_config(tmp_path, config)
    assert train.main(_flags(slice_dir, tmp_path, "--steps", "1")) == 0
    assert "other software" not in capsys.readouterr().out
    assert [e["step"] for e in load_run_config(tmp_path)["environments"]] == [0, 0]


def test_a_run_config_with_an_emptied_model_section_is_one_line(slice_dir, tmp_path, capsys):
    # It was a KeyError traceback, then a TypeError one.
    assert train.main(_flags(slice_dir, tmp_path, "--steps", "4")) == 0
    # One checkpoint is enough to hold the run to its settings.
    assert train.main(["--workdir", str(tmp_path), "--seed", "3", "--steps", "8"]) == 2
    assert "--seed 0 there, 3 now" in capsys.readouterr().err
    config = load_run_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model": {}}))
    capsys.readouterr()
    assert train.main(["--workdir", str(tmp_path), "--steps", "8", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the workdir's config.json has incomplete model settings (")
    assert err.count("\n") == 1 and checkpoint_steps(tmp_path) == [4]


@pytest.mark.parametrize(
    "field, value, difference",
    [("pad_id", 1, "pad_id 1 there, 0 now"), ("vocab_size", 500, "--vocab-size 500 there, 400")],
)
def test_a_run_config_whose_model_disagrees_with_its_tokenizer_is_one_line(
    straight_run, tmp_path, capsys, field, value, difference
):
    # An edited config.json: the model must not be built with another padding id or
    # vocabulary than the tokenizer's. pad_id is the tokenizer's, so the error names the
    # setting, not a --pad-id flag that does not exist.
    run = tmp_path / "run"
    shutil.copytree(straight_run, run)
    config = load_run_config(run)
    config["model"][field] = value
    save_run_config(run, config)
    assert train.main(["--workdir", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run} holds a run with other model settings ({difference}")
    assert err.count("\n") == 1 and checkpoint_steps(run) == [8, 12, 16]


def test_a_tokenizer_other_than_the_runs_is_refused_where_its_vocabulary_size_agrees(
    straight_run, multi30k_dir, tmp_path, capsys
):
    # Another run's tokenizer.model copied in, or one trained again by another SentencePiece
    # version: the same number of pieces, other ids. Training and evaluate.py went on with it
    # and no error, every id of the checkpoints now another piece.
    import data
    import evaluate

    run = tmp_path / "run"
    shutil.copytree(straight_run, run)
    own = (run / "tokenizer.model").read_bytes()
    assert load_run_config(run)["tokenizer"] == {"sha256": hashlib.sha256(own).hexdigest()}
    other_lines = (multi30k_dir / "train.de").read_text().splitlines()[-300:]
    other = data.train_tokenizer(other_lines, tmp_path / "other.model", vocab_size=400)
    assert other.vocab_size == 400 and other.fingerprint != hashlib.sha256(own).hexdigest()
    shutil.copy(other.path, run / "tokenizer.model")
    refused = (
        f"error: {run / 'tokenizer.model'} is not the tokenizer this run trained with (SHA-256 "
        f"{other.fingerprint[:12]}..., where config.json records "
        f"{hashlib.sha256(own).hexdigest()[:12]}...): its ids would be other pieces to the "
        "checkpoints; put back the run's own tokenizer.model, or train into a new --workdir\n"
    )
    capsys.readouterr()
    assert train.main(["--workdir", str(run), "--steps", "20", "--no-progress"]) == 2
    assert capsys.readouterr().err == refused
    assert checkpoint_steps(run) == [8, 12, 16]
    assert evaluate.main(["--workdir", str(run), "--split", "val", "--no-progress"]) == 2
    assert capsys.readouterr().err.endswith(refused)
    # Deleted, as a damaged one's error advises, it is trained again the same from the
    # run's data, and the run goes on.
    (run / "tokenizer.model").unlink()
    assert train.main(["--workdir", str(run), "--steps", "20", "--no-progress"]) == 0
    assert (run / "tokenizer.model").read_bytes() == own and checkpoint_steps(run)[-1] == 20
    # A run from before the record is not refused, and its resume records its tokenizer.
    config = load_run_config(run)
    del config["tokenizer"]
    save_run_config(run, config)
    assert train.main(["--workdir", str(run), "--steps", "24", "--no-progress"]) == 0
    assert load_run_config(run)["tokenizer"] == {"sha256": hashlib.sha256(own).hexdigest()}


def test_damaged_latest_checkpoint_is_reported_and_the_one_before_used(
    straight_run, slice_dir, tmp_path, capsys
):
    assert train.main(_flags(slice_dir, tmp_path, "--steps", "8")) == 0
    for f in (tmp_path / "checkpoints" / "8" / "params").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00not a checkpoint")
    capsys.readouterr()
    assert train.main(["--workdir", str(tmp_path), "--steps", "12", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint step 8" in out and "damaged" in out and "resumed from step 4" in out
    # Steps 5..12 are redone from step 4: the same parameters as the straight run's step 12.
    _params_equal(restore_params(tmp_path, 12)[0], restore_params(straight_run, 12)[0])


def test_gradient_clipping_can_be_turned_on_and_off_when_resuming(
    straight_run, slice_dir, tmp_path, capsys
):
    # After a non-finite loss the advice is to set --clip-grad-norm and resume. Clipping adds
    # a level to the optimizer state: every checkpoint was then "damaged and skipped", and
    # the advice was to delete them. A norm no gradient reaches clips nothing, so turned
    # on at step 4 and off at step 8, the run is the straight one, Adam's moments carried,
    # but for rounding: the step with clipping is another program.
    assert train.main(_flags(slice_dir, tmp_path, "--steps", "4")) == 0
    capsys.readouterr()
    assert train.main(_flags(slice_dir, tmp_path, "--steps", "8", "--clip-grad-norm", "1e9")) == 0
    out, err = capsys.readouterr()
    assert "damaged" not in out + err and "resumed from step 4" in out
    assert load_run_config(tmp_path)["train"]["grad_clip_norm"] == 1e9
    # A resume without the flag keeps the run's setting; off again is --clip-grad-norm 0
    # (before, 0 was refused: no flag could turn it off).
    assert train.main(_flags(slice_dir, tmp_path, "--steps", "12", "--clip-grad-norm", "0")) == 0
    out, err = capsys.readouterr()
    assert "damaged" not in out + err and "resumed from step 8" in out
    assert "--clip-grad-norm 1000000000.0 -> off" in out
    assert load_run_config(tmp_path)["train"]["grad_clip_norm"] is None
    resumed = jax.tree_util.tree_leaves_with_path(restore_params(tmp_path, 12)[0])
    straight = jax.tree.leaves(restore_params(straight_run, 12)[0])
    for (path, x), y in zip(resumed, straight, strict=True):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        # Measured: at most 2.4e-7 apart; with Adam's state started anew at each resume, 0.14.
        # The key biases have a gradient of zero but for rounding, which Adam scales up
        # (training.py's docstring): 0.011 apart, with no effect on any output.
        if not name.endswith("key/bias"):
            np.testing.assert_allclose(x, y, rtol=0, atol=2e-6, err_msg=name)


def test_weight_decay_can_be_turned_on_and_off_when_resuming(slice_dir, tmp_path, capsys):
    # Weight decay, like clipping, adds a place holder to the optimizer state; a resume
    # that turns it on or off keeps Adam's moments and the schedule's count. A decay too
    # small to move a weight leaves a plain-Adam run's parameters but for rounding.
    plain = tmp_path / "plain"
    assert train.main(_flags(slice_dir, plain, "--steps", "12", "--weight-decay", "0")) == 0
    run = tmp_path / "run"
    assert train.main(_flags(slice_dir, run, "--steps", "4", "--weight-decay", "0")) == 0
    # A run from before the setting existed (plain Adam) resumes as plain Adam, and says
    # nothing changed, though the flag's default is now another.
    config = load_run_config(run)
    del config["train"]["weight_decay"]
    (run / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert train.main(_flags(slice_dir, run, "--steps", "6")) == 0
    out = capsys.readouterr().out
    assert "resumed from step 4" in out and "--weight-decay" not in out
    assert load_run_config(run)["train"]["weight_decay"] == 0.0
    assert train.main(_flags(slice_dir, run, "--steps", "8", "--weight-decay", "1e-20")) == 0
    out, err = capsys.readouterr()
    assert "damaged" not in out + err and "resumed from step 6" in out
    assert "--weight-decay 0.0 -> 1e-20" in out
    assert load_run_config(run)["train"]["weight_decay"] == 1e-20
    # On with clipping on too, then both off: every pairing of the two restores.
    assert train.main(_flags(slice_dir, run, "--steps", "10", "--clip-grad-norm", "1e9")) == 0
    assert train.main(_flags(slice_dir, run, "--steps", "12", "--weight-decay", "0",
                             "--clip-grad-norm", "0")) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert "damaged" not in out + err and "resumed from step 10" in out
    assert load_run_config(run)["train"]["weight_decay"] == 0.0
    resumed = jax.tree_util.tree_leaves_with_path(restore_params(run, 12)[0])
    straight = jax.tree.leaves(restore_params(plain, 12)[0])
    for (path, x), y in zip(resumed, straight, strict=True):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        if not name.endswith("key/bias"):  # as in the clipping test above
            np.testing.assert_allclose(x, y, rtol=0, atol=2e-6, err_msg=name)


def test_weight_decay_shrinks_the_trained_matrices(straight_run, slice_dir, tmp_path):
    # The flag reaches the optimizer: a strong decay ends with smaller kernels and
    # embeddings than the straight run (the default decay, 0.1) of the same steps.
    assert train.main(_flags(slice_dir, tmp_path, "--steps", "16", "--weight-decay", "5")) == 0
    decayed = jax.tree_util.tree_leaves_with_path(restore_params(tmp_path, 16)[0])
    straight = jax.tree.leaves(restore_params(straight_run, 16)[0])
    matrices = [(np.linalg.norm(x), np.linalg.norm(y))
                for (_, x), y in zip(decayed, straight, strict=True) if x.ndim >= 2]  # fmt: skip
    assert matrices and all(a < 0.9 * b for a, b in matrices)


def test_cooldown_shape_flag_offers_every_shape_the_schedule_has():
    # train.py spells the choices out so that --help needs no JAX import; they must not drift.
    flag = train.build_parser()._option_string_actions["--cooldown-shape"]
    assert tuple(flag.choices) == training.COOLDOWN_SHAPES


@pytest.mark.parametrize("shape", training.COOLDOWN_SHAPES)
def test_cooldown_ends_the_run_at_a_learning_rate_near_zero(slice_dir, tmp_path, shape):
    extra = ["--steps", "8", "--cooldown", "0.5", "--log-every", "1", "--checkpoint-every", "8"]
    if shape != "linear":
        extra += ["--cooldown-shape", shape]
    assert train.main(_flags(slice_dir, tmp_path, *extra)) == 0
    saved = load_run_config(tmp_path)["train"]
    assert (saved["cooldown"], saved["cooldown_shape"]) == (0.5, shape)
    lr = {r["step"]: r["lr"] for r in read_metrics(tmp_path) if "lr" in r}

    def paper(step):  # --preset tiny (d_model 32), --warmup-steps 10, --lr-scale 0.5
        return 0.5 * 32**-0.5 * min(step**-0.5, step * 10**-1.5)

    # The paper's rate for steps 1-4, then x 4/4, 3/4, 2/4, 1/4 over the last 4 of 8
    # (linear), or x 1 - sqrt(0/4), 1 - sqrt(1/4), ... (sqrt).
    left = [min(1.0, (9 - s) / 4) for s in range(1, 9)]
    factor = left if shape == "linear" else [1 - math.sqrt(1 - x) for x in left]
    expected = [paper(s) * f for s, f in zip(range(1, 9), factor, strict=True)]
    np.testing.assert_allclose([lr[s] for s in range(1, 9)], expected, rtol=1e-5)


@pytest.mark.parametrize(
    "flags, difference",
    [
        (["--d-model", "64"], "--d-model 32 there, 64 now"),
        # The flags left out take --preset's values: it is named, as the user left out
        # --d-model already.
        (["--preset", "small"], "now); leave --preset small and those flags out to resume"),
        (["--dropout-rate", "0.2"], "--dropout-rate 0.1 there, 0.2 now); leave those flags"),
    ],
)
def test_resuming_with_another_model_config_is_a_one_line_error_before_the_data_is_read(
    straight_run, capsys, monkeypatch, flags, difference
):
    # A --preset given on a resume is not ignored (the run would go on with the saved model).
    # The error came once the data was read and encoded (minutes for a large corpus), after
    # a line that the resume was taken.
    def not_read(*args, **kwargs):
        raise AssertionError("the data was read before the model flags were checked")

    monkeypatch.setattr(train, "load_training_data", not_read)
    code = train.main(["--workdir", str(straight_run), *flags, "--steps", "20"])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1
    assert difference in err and "resuming with settings" not in out


def test_resuming_with_another_seed_is_a_one_line_error_that_leaves_the_run_resumable(
    straight_run, capsys
):
    # The seed drew the checkpoint's data order: resuming with another one cannot go on,
    # and must not write the new seed into config.json, which the plain resume then reads.
    config = (straight_run / "config.json").read_bytes()
    code = train.main(["--workdir", str(straight_run), "--seed", "3", "--steps", "20"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert "other train settings (--seed 0 there, 3 now)" in err
    assert (straight_run / "config.json").read_bytes() == config


def test_resuming_with_other_data_settings_is_an_error_before_the_data_is_read(straight_run):
    with pytest.raises(CheckpointError, match=r"other data settings \(--vocab-size 400 there, 500"):
        train.run_settings(_parse("--workdir", straight_run, "--vocab-size", "500"), print)


def _without_max_len(flags):
    i = flags.index("--max-len")
    return flags[:i] + flags[i + 2 :]


def test_a_run_killed_before_its_first_checkpoint_starts_again_with_the_settings_asked(
    slice_dir, tmp_path
):
    # Its config.json is written as training starts: no checkpoint ties these settings, so
    # none holds the next run back, and nothing is resumed. Its max_len was still taken:
    # --preset tiny after a mini run trained tiny on mini's 128-token pairs and recorded
    # both, and the plain resume was then refused ("--max-len 128 there, 64 now").
    workdir = tmp_path / "run"
    first = _parse(*_without_max_len(_flags(slice_dir, workdir, "--preset", "mini")))
    settings = train.run_settings(first, print)
    model = train.model_config(first, None, settings.data["vocab_size"], pad_id=0)
    sections = {"model": model, "data": settings.data, "train": settings.train}
    save_run_config(workdir, {k: v if k == "data" else v.to_dict() for k, v in sections.items()})
    assert model.max_len == 128 and checkpoint_steps(workdir) == []
    again = _without_max_len(_flags(slice_dir, workdir, "--d-model", "64", "--vocab-size", "500"))
    again = _parse(*again, "--seed", "3")
    logged = []
    settings = train.run_settings(again, logged.append)  # no CheckpointError
    assert logged == []  # no "resuming with settings other than the run's"
    assert (settings.data["vocab_size"], settings.train.seed) == (500, 3)
    model = train.model_config(again, settings.saved, 500, pad_id=0)
    assert (model.d_model, model.max_len) == (64, 64)
    assert settings.data["max_len"] == 64  # the pairs kept, as tiny's


def test_the_run_config_is_written_only_once_the_checkpoint_is_restored(
    straight_run, monkeypatch, capsys
):
    from transformer.checkpoints import CheckpointError

    def fails(self, batcher=None):
        raise CheckpointError("cannot restore (a stand-in for any failure)")

    monkeypatch.setattr(training.Trainer, "restore_or_init", fails)
    config = (straight_run / "config.json").read_bytes()
    assert train.main(["--workdir", str(straight_run), "--steps", "20"]) == 2
    assert "cannot restore" in capsys.readouterr().err
    assert (straight_run / "config.json").read_bytes() == config  # still "steps": 16


def test_resuming_with_fewer_steps_than_done_trains_nothing_and_keeps_the_run_config(
    straight_run, capsys
):
    # The checkpoint is at step 16: --steps 8 has nothing to train, and must not write
    # "steps": 8 into config.json, which a plain resume would then read.
    config = (straight_run / "config.json").read_bytes()
    steps = checkpoint_steps(straight_run)
    for asked in ("8", "16"):  # 16: the finished run's command, run again
        assert train.main(["--workdir", str(straight_run), "--steps", asked]) == 0
        out = capsys.readouterr().out
        assert f"already at step 16 of the {asked} asked for: nothing to train" in out
        assert "done:" not in out
        assert (straight_run / "config.json").read_bytes() == config
        assert checkpoint_steps(straight_run) == steps == [8, 12, 16]


def test_tokenized_splits_a_run_no_longer_reads_are_removed_once_it_trains(
    straight_run, tmp_path, capsys
):
    # Before, the ids of edited data or of a tokenizer trained again stayed in cache/ for
    # ever. A run that trains nothing leaves the workdir as it found it.
    run = tmp_path / "run"
    shutil.copytree(straight_run, run)
    in_use = sorted((run / "cache").glob("encoded-*.npz"))
    assert len(in_use) == 2  # the train and val splits
    stale = run / "cache" / ("encoded-" + "0" * 32 + ".npz")
    shutil.copy(in_use[0], stale)
    stuck = run / "cache" / ("encoded-" + "1" * 32 + ".npz")
    stuck.mkdir()  # a stale split that cannot be removed is a warning; training goes on
    assert train.main(["--workdir", str(run), "--steps", "16"]) == 0  # nothing to train
    assert stale.exists()
    capsys.readouterr()
    assert train.main(["--workdir", str(run), "--steps", "17"]) == 0
    out = capsys.readouterr().out
    assert (
        f"data: removed 1 tokenized split(s) of other data or another tokenizer from {run}" in out
    )
    assert f"warning: could not remove a stale tokenized split: {stuck}: Is a directory\n" in out
    assert sorted((run / "cache").iterdir()) == sorted([*in_use, stuck])


def test_non_finite_loss_exits_1_with_the_step_and_keeps_the_last_checkpoint(
    slice_dir, tmp_path, capsys, monkeypatch
):
    # Every step's loss goes through check_finite_loss; make it see a NaN at step 6.
    real_check = training.check_finite_loss
    monkeypatch.setattr(
        training,
        "check_finite_loss",
        lambda step, loss: real_check(step, float("nan") if step == 6 else loss),
    )
    code = train.main(_flags(slice_dir, tmp_path, "--steps", "12"))
    err = capsys.readouterr().err
    assert code == 1
    assert "loss is nan at step 6" in err and err.count("\n") == 1
    assert checkpoint_steps(tmp_path) == [4]
    assert restore_params(tmp_path, "last")[1] == 4


def test_check_finite_loss():
    training.check_finite_loss(3, 1.5)
    with pytest.raises(NonFiniteLossError, match="inf at step 9"):
        training.check_finite_loss(9, float("inf"))
    # NaN compares unequal to everything: a check such as `loss > 1e30` would let it by.
    with pytest.raises(NonFiniteLossError, match="^training loss is nan at step 4; "):
        training.check_finite_loss(4, float("nan"))
    with pytest.raises(NonFiniteLossError, match="-inf at step 2"):
        training.check_finite_loss(2, float("-inf"))


def _cli(*args, timeout=120, **kwargs):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def test_help_documents_every_flag():
    result = _cli("--help")
    assert result.returncode == 0
    for flag in (
        "--workdir --data-dir --dataset --tfds-name --src --tgt --vocab-size --tokenizer-type "
        "--max-tokens --preset --d-model --num-heads --d-ff --num-encoder-layers "
        "--num-decoder-layers --dropout-rate --attention-dropout-rate --max-len "
        "--share-embeddings --no-share-embeddings --attention-bias --no-attention-bias "
        "--pre-layer-norm --dtype --matmul-dtype --steps --epochs --warmup-steps --lr-scale "
        "--label-smoothing --weight-decay "
        "--clip-grad-norm --seed --log-every --eval-every --bleu-every --checkpoint-every "
        "--keep-checkpoints "
        "--coordinator-address --num-processes --process-id"
    ).split():
        # An option line of its own: other flags' help names some of them.
        option_line = rf"^ +(--[\w-]+, )?{re.escape(flag)}\b"  # "  --a, --no-a" names both
        assert re.search(option_line, result.stdout, re.MULTILINE), flag
    parser = train.build_parser()
    assert all(action.help != argparse.SUPPRESS for action in parser._actions)


@pytest.mark.parametrize("argv", [["--stpes", "30"], ["--steps", "many"]])
def test_a_mistyped_flag_is_one_line_not_the_whole_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert argv[0] in err and err.endswith("; train.py --help lists the flags\n")


def test_steps_and_epochs_together_are_a_one_line_usage_error(capsys):
    # Either one decides the run's length; given both, --steps won without a word.
    with pytest.raises(SystemExit) as exit_:
        train.main(["--workdir", "unused", "--steps", "5", "--epochs", "2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--epochs: not allowed with argument --steps" in err and err.count("\n") == 1


def test_library_tokenizer_default_is_the_command_line_default():
    """A tokenizer trained through `data` without a size matches what `train.py` trains.

    train.py keeps its defaults in a table so that --help needs no imports; the
    library's default lives in data/tokenizer.py; both are changed together.
    """
    import data

    assert train.DATA_DEFAULTS["vocab_size"] == data.DEFAULT_VOCAB_SIZE


def test_bad_data_flag_is_a_one_line_error_and_exit_2(tmp_path):
    result = _cli("--workdir", str(tmp_path / "run"), "--dataset", "files", "--data-dir",
                  str(tmp_path / "missing"))  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: data directory {tmp_path / 'missing'} not found")
    assert result.stderr.count("\n") == 1


def test_contradicting_data_flags_are_an_error_before_anything_is_written(tmp_path):
    # Before, --tfds-name without --dataset tfds was dropped: a Multi30k model was trained.
    result = _cli("--workdir", str(tmp_path / "run"), "--tfds-name", "wmt14_translate/de-en")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "--tfds-name wmt14_translate/de-en is for --dataset tfds" in result.stderr
    assert not (tmp_path / "run").exists()
    # And --tfds-data-dir with the files dataset (before: silently not read).
    result = _cli("--workdir", str(tmp_path / "run"), "--dataset", "files", "--data-dir",
                  str(tmp_path), "--tfds-data-dir", str(tmp_path / "tfds"))  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert f"--tfds-data-dir {tmp_path / 'tfds'} is for --dataset tfds, not files" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("no_progress", [False, True])
def test_no_progress_turns_off_tfds_bars_too(no_progress, slice_dir, tmp_path, monkeypatch):
    pytest.importorskip("tensorflow_datasets")  # the tfds extra, as tests/test_data_tfds.py
    from data import tfds_source

    monkeypatch.setattr(tfds_source, "_progress_bars", True)  # the process's own setting
    flags = _flags(slice_dir, tmp_path / "run", "--steps", "1", "--dataset", "tfds")
    flags += ["--tfds-data-dir", str(tmp_path / "tfds")]
    if not no_progress:
        flags.remove("--no-progress")
    with open(tmp_path / "stderr", "w+", encoding="utf-8") as terminal:
        terminal.isatty = lambda: True  # what a terminal says
        monkeypatch.setattr(sys, "stderr", terminal)
        assert train.main(flags) == 0
        terminal.seek(0)
        written = terminal.read()
    assert ("Generating splits" in written) != no_progress, written


def test_a_training_split_cleaning_empties_is_a_one_line_error(slice_dir, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for name in ("val.en", "val.de"):
        (empty / name).write_bytes((slice_dir / name).read_bytes())
    (empty / "train.en").write_text("a man\n\n")
    (empty / "train.de").write_text("\n\n")  # every pair has an empty side
    assert train.main(_flags(empty, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    files = f"in {empty / 'train.en'} and {empty / 'train.de'} ("
    assert err.startswith(f"error: the training split has no usable pairs {files}")
    assert "2 skipped" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--dropout-rate", "0.999", "bad model settings: --dropout-rate must be in [0, 1) and"),
        ("--d-model", "130", "bad model settings: --d-model (130) must be divisible by --num-h"),
        ("--num-decoder-layers", "0", "bad model settings: --num-decoder-layers must be >= 1"),
        ("--lr-scale", "0", "bad training settings: --lr-scale must be > 0 and finite, got 0.0"),
        ("--lr-scale", "nan", "bad training settings: --lr-scale must be > 0 and finite, got nan"),
        ("--adam-eps", "inf", "bad training settings: --adam-eps must be > 0 and finite, got inf"),
        ("--seed", "-1", "bad training settings: --seed must be in [0, 2**32), got -1"),
        ("--clip-grad-norm", "-1", "--clip-grad-norm must be a finite number > 0, or 0 to turn"),
        ("--adam-b2", "1", "bad training settings: --adam-b2 must be in [0, 1), got 1.0"),
        ("--max-shapes", "0", "bad data settings: --max-shapes must be >= 1, got 0"),
        ("--max-tokens", "-5", "bad data settings: --max-tokens must be >= 1, got -5"),
        ("--vocab-size", "0", "bad data settings: --vocab-size must be >= 1, got 0"),
        ("--preset", "Mini", "--preset: unknown preset 'Mini'; choose from base, big, mini, sm"),
    ],
)
def test_bad_setting_is_a_one_line_error_naming_the_flag_before_anything_is_written(
    slice_dir, tmp_path, capsys, flag, value, message
):
    workdir = tmp_path / "run"
    assert train.main(_flags(slice_dir, workdir, flag, value)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    # No tokenizer was trained into the workdir, so the corrected command starts clean.
    assert not workdir.exists()


@pytest.mark.parametrize(
    "phase, signum",
    [("load_training_data", signal.SIGINT), ("restore_or_init", signal.SIGTERM)],
)
def test_a_stop_request_before_training_ends_the_run_with_one_line_and_saves_nothing(
    slice_dir, tmp_path, monkeypatch, capsys, phase, signum
):
    # Ctrl-C while the data or the state loads (tokenizing a corpus takes a while) was
    # lost in a callback of XLA's, or came out as a raw traceback.
    owner = train if phase == "load_training_data" else training.Trainer
    loads = getattr(owner, phase)

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signum)
        return loads(*args, **kwargs)

    monkeypatch.setattr(owner, phase, interrupted)
    workdir = tmp_path / "run"
    # Python's own handlers, or SIGINT ignored where the suite runs as a background job
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert train.main(_flags(slice_dir, workdir, "--steps", "4")) == 128 + signum
    out, err = capsys.readouterr()
    assert f"{signal.Signals(signum).name}: before training starts, then stopping" in out + err
    assert err.startswith("error: stopped before training started") and err.count("\n") == 1
    assert not workdir.exists()  # the tokenizer, cache and checkpoints folder taken back
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # put back


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-processes", "0"], "--num-processes must be >= 1, got 0"),
        (["--num-processes", "2", "--process-id", "3"], "--process-id must be in [0, --num-p"),
        (["--num-processes", "2", "--process-id", "2"], "--process-id must be in [0, --num-p"),
        (["--process-id", "-1"], "--process-id must be in [0, --num-processes), got -1"),
        (["--coordinator-address", "notahostport"], "--coordinator-address must be HOST:PORT"),
        (["--coordinator-address", "host:1234:5678"], "--coordinator-address must be HOST:PORT"),
        (["--coordinator-address", "localhost:70000"], "--coordinator-address must be HOST:POR"),
        (["--coordinator-address", "localhost:0"], "--coordinator-address must be HOST:PORT"),
        (["--num-processes", "2", "--process-id", "0"], "cannot start the multi-host run ("),
    ],
    ids=[
        "no-processes",
        "id-too-big",
        "id-equal",
        "id-negative",
        "no-port",
        "two-ports",
        "port-too-big",
        "port-zero",
        "no-coordinator",
    ],
)
def test_bad_multi_host_flags_are_a_one_line_error_before_anything_is_written(
    slice_dir, tmp_path, capsys, flags, message
):
    workdir = tmp_path / "run"
    assert train.main(_flags(slice_dir, workdir, *flags)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not workdir.exists()


def test_multi_host_flags_reach_jax_distributed_and_one_process_is_a_run_alone(monkeypatch, capsys):
    # A job script written for N hosts, run with --num-processes 1: one host, no watcher
    # of the others' failures, and process 0 does not say it waits for a coordinator.
    started = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: started.append(kwargs))
    hosts = ["--coordinator-address", "localhost:1234", "--num-processes", "1", "--process-id", "0"]
    assert train.maybe_initialize_distributed(_parse(*hosts)) is None
    assert started == [dict(coordinator_address="localhost:1234", num_processes=1, process_id=0)]
    assert capsys.readouterr().err == ""


def test_a_workdir_that_is_a_file_is_named_as_one_and_left_as_it_was(tmp_path):
    (tmp_path / "notes").write_text("the user's")
    with pytest.raises(train.UsageError, match="^--workdir .*notes is a file, not a directory$"):
        train.run_settings(_parse("--workdir", tmp_path / "notes"), print)
    assert (tmp_path / "notes").read_text() == "the user's"


def test_an_empty_preset_is_an_error_not_the_default_model():
    # --preset "$PRESET" with the variable unset trained mini without a word.
    with pytest.raises(train.UsageError, match="^--preset: unknown preset ''; choose from"):
        train.check_preset(_parse("--preset", ""))


def test_the_dtype_flags_reach_the_model_config():
    args = _parse("--dtype", "bfloat16", "--matmul-dtype", "bfloat16")
    config = train.model_config(args, None, vocab_size=400, pad_id=0)
    assert (config.dtype, config.matmul_dtype) == ("bfloat16", "bfloat16")


@pytest.mark.parametrize(
    "name, message, code", [("", "--workdir is empty", 2), ("x" * 300, "File name too long", 1)]
)
def test_an_impossible_workdir_name_is_a_one_line_error(
    slice_dir, tmp_path, monkeypatch, capsys, name, message, code
):
    # An empty name used to train into the default runs/ folder; a too-long one gave a
    # traceback.
    monkeypatch.chdir(tmp_path)
    flags = _flags(slice_dir, "unused")
    flags[flags.index("unused")] = str(tmp_path / name) if name else ""
    assert train.main(flags) == code
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flag", ["--data-dir", "--tfds-data-dir"])
def test_an_empty_data_folder_is_a_one_line_error(tmp_path, monkeypatch, capsys, flag):
    # "--data-dir $DATA" with $DATA unset read the current folder.
    monkeypatch.chdir(tmp_path)
    assert train.main(["--workdir", "run", flag, "", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {flag} is empty: name a folder, or leave the flag out\n"
    assert not (tmp_path / "run").exists()


def test_ctrl_c_while_the_libraries_load_ends_the_run_in_one_line(
    slice_dir, tmp_path, run_ctrl_c_while_loading
):
    # It printed a 30-line import traceback, or JAX's garbage-collection callback dropped
    # the KeyboardInterrupt and the run trained to the end.
    result = run_ctrl_c_while_loading("train.py", *_flags(slice_dir, tmp_path / "run"))
    assert result.returncode == 130
    assert result.stderr == "error: interrupted before training started\n"
    assert not (tmp_path / "run").exists()


def test_sigterm_saves_a_checkpoint_and_exits_0(slice_dir, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    args = _flags(slice_dir, tmp_path, "--steps", "100000")
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 180
        while not (tmp_path / "checkpoints" / "4").is_dir():  # a finished first checkpoint
            assert process.poll() is None, process.communicate()
            assert time.time() < deadline, "no checkpoint within 180 s"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert "interrupted at step" in out
    assert f"Resume with: python train.py --workdir {tmp_path}" in out
    stopped_at = int(out.split("interrupted at step ")[1].split(";")[0])
    assert stopped_at >= 4 and checkpoint_steps(tmp_path)[-1] == stopped_at
    _, step = restore_params(tmp_path, "last")
    assert step == stopped_at
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 100000


# train.py, held at its step 12 record for 10 minutes: what it printed before then must
# reach its stdout while it runs (a log of about 1 KiB, well under a write block).
HELD_AT_STEP_12 = (
    "import time; from transformer import training; write = training.MetricsLog.write\n"
    "def held(self, step, values):\n"
    "    if step >= 12: time.sleep(600)\n"
    "    write(self, step, values)\n"
    "training.MetricsLog.write = held\n"
    "import train; from transformer.compilation_cache import exit_process; "
    "exit_process(train.main)"
)


def test_the_log_reaches_a_file_or_a_pipe_while_training(slice_dir, tmp_path, users_environment):
    # `python train.py > train.log` or `| tee`: stdout was written in 8 KiB blocks, so
    # `tail -f` showed none of an hour's log until the run ended.
    env = {**users_environment, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    args = _flags(slice_dir, tmp_path, "--steps", "100000")
    process = subprocess.Popen(
        [sys.executable, "-c", HELD_AT_STEP_12, *args], env=env, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    out = b""
    try:
        deadline = time.time() + 120
        while b"\nstep 8/100000: loss " not in out:
            assert process.poll() is None, out.decode()
            assert time.time() < deadline, f"no step 8 line within 120 s: {out.decode()}"
            if select.select([process.stdout], [], [], 0.2)[0]:
                out += os.read(process.stdout.fileno(), 1 << 16)
    finally:
        process.kill()
        process.wait()
    assert b"\nstep 4/100000: loss " in out and out.startswith(b"data: ")


def test_a_closed_stdout_saves_a_checkpoint_and_exits_0(slice_dir, tmp_path, users_environment):
    # `python train.py | head`, or a `| tee log` that was killed: the next log line raised
    # BrokenPipeError, and the run ended with status 1 and nothing saved since the last
    # checkpoint.
    env = {**users_environment, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    args = _flags(slice_dir, tmp_path, "--steps", "100000", "--checkpoint-every", "1000")
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        for line in process.stdout:  # as `head` reads, up to the step 8 line
            if line.startswith(b"step 8/100000: "):
                break
        process.stdout.close()  # the reader is gone
        assert process.wait(timeout=120) == 0, process.stderr.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
    assert (
        process.stderr.read()
        .decode()
        .endswith(
            "stdout was closed (a broken pipe): saving a checkpoint, then stopping (a Ctrl-C now "
            "stops at once, maybe before it)\n"
        )
    )
    last = checkpoint_steps(tmp_path)[-1]  # none was due before step 1000
    assert last >= 12 and restore_params(tmp_path, "last")[1] == last


def test_a_hung_up_terminal_saves_a_checkpoint_and_exits_0(slice_dir, tmp_path):
    # A closed terminal or a dropped SSH session: SIGHUP ended the run unsaved, and after
    # the hang-up every write to the terminal fails with EIO.
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    args = _flags(slice_dir, tmp_path, "--steps", "100000")
    terminal, child_side = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args], env=env,
        stdin=subprocess.DEVNULL, stdout=child_side, stderr=child_side,
    )  # fmt: skip
    os.close(child_side)
    written = []
    try:
        deadline = time.time() + 180
        while not checkpoint_steps(tmp_path):  # a finished first checkpoint
            if select.select([terminal], [], [], 0.2)[0]:  # keep the terminal drained
                written.append(os.read(terminal, 1 << 16))
            assert process.poll() is None, b"".join(written).decode()
            assert time.time() < deadline, "no checkpoint within 180 s"
        process.send_signal(signal.SIGHUP)  # what the shell of a closed terminal sends
        os.close(terminal)  # the terminal goes away: the child's writes to it fail from now
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0
    last = checkpoint_steps(tmp_path)[-1]
    assert last > 4 and restore_params(tmp_path, "last")[1] == last  # saved at the signal


def test_a_broken_val_split_stops_the_run_before_anything_is_written_a_missing_one_does_not(
    slice_dir, tmp_path, capsys
):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for path in slice_dir.iterdir():
        (data_dir / path.name).write_bytes(path.read_bytes())
    workdir = tmp_path / "run"
    val_de = (slice_dir / "val.de").read_bytes().split(b"\n")
    (data_dir / "val.de").write_bytes(b"\n".join(val_de[:-2]) + b"\n")  # one line short
    assert train.main(_flags(data_dir, workdir)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "val.de has 23 lines" in err and err.count("\n") == 1
    for lang in ("en", "de"):
        (data_dir / f"val.{lang}").write_bytes(b"\n\n")
    assert train.main(_flags(data_dir, workdir)) == 2
    err = capsys.readouterr().err
    files = f"in {data_dir / 'val.en'} and {data_dir / 'val.de'} ("
    assert err.startswith(f"error: the validation split has no usable pairs {files}")
    assert err.count("\n") == 1
    assert not workdir.exists()
    for lang in ("en", "de"):  # no val split at all: a run without validation
        (data_dir / f"val.{lang}").unlink()
    assert train.main(_flags(data_dir, workdir, "--steps", "4")) == 0
    assert "warning: no validation: no split 'val'" in capsys.readouterr().out


def test_a_data_error_after_the_tokenizer_is_trained_leaves_the_workdir_as_it_was(
    slice_dir, tmp_path, capsys
):
    # --max-len 2 drops every pair, found only once the tokenizer is trained and the
    # corpus encoded: they were left behind in the workdir, tied to no run config.
    # A stray tokenizer the run moved aside is put back.
    new, used = tmp_path / "new" / "run", tmp_path / "used"
    used.mkdir()
    before = {
        "notes.txt": b"the user's",
        "tokenizer.model": b"stray",
        "tokenizer.model.old": b"old",
    }
    for name, content in before.items():
        (used / name).write_bytes(content)
    for workdir in (new, used):
        assert train.main(_flags(slice_dir, workdir, "--max-len", "2")) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: no training pairs left") and err.count("\n") == 1
    assert not (tmp_path / "new").exists()  # nor the folder made to hold it
    assert {p.name: p.read_bytes() for p in used.iterdir()} == before


def test_a_second_ctrl_c_does_not_cut_short_taking_back_what_the_run_wrote(tmp_path, monkeypatch):
    # The first stop request ends the run before training; a second Ctrl-C while the run
    # removes what it wrote (here, as it removes cache/) raised KeyboardInterrupt there and
    # left the stray tokenizer it had moved aside under its .old name.
    workdir = tmp_path / "run"
    workdir.mkdir()
    aside = workdir / "tokenizer.model.old"
    aside.write_bytes(b"stray")  # as forget_unchecked_tokenizer leaves it
    rmtree = shutil.rmtree

    def rmtree_during_a_second_ctrl_c(path, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # where the SIGINT handler runs
        rmtree(path, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree_during_a_second_ctrl_c)

    class SecondCtrlC(Exception):
        """Where train's handler raises KeyboardInterrupt, which would end the test session."""

    def second_ctrl_c(signum, frame):
        raise SecondCtrlC

    previous = signal.signal(signal.SIGINT, second_ctrl_c)
    try:
        with pytest.raises(train.PreTrainingStop):
            with train.removed_if_stopped_before_training(workdir, True, threading.Event(), aside):
                (workdir / "cache").mkdir()
                (workdir / "tokenizer.model").write_bytes(b"trained")
                raise train.PreTrainingStop("stopped before training started")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert {p.name: p.read_bytes() for p in workdir.iterdir()} == {"tokenizer.model": b"stray"}


def test_a_ctrl_c_while_the_data_loads_takes_back_the_files_and_folders_the_run_made(tmp_path):
    # A second Ctrl-C before training raises KeyboardInterrupt, which is no Exception. The
    # workdir is made here where no lock made it first (a system without fcntl).
    workdir = tmp_path / "new" / "run"
    with pytest.raises(KeyboardInterrupt):
        with train.removed_if_stopped_before_training(workdir, True, threading.Event(), None):
            (workdir / "cache").mkdir(parents=True)
            (workdir / "tokenizer.model").write_bytes(b"half-trained")
            raise KeyboardInterrupt
    assert not (tmp_path / "new").exists()


def test_a_tokenizer_no_run_config_ties_to_the_data_is_moved_aside(
    slice_dir, straight_run, multi30k_tokenizer, tmp_path
):
    # As a run that stopped after training its tokenizer, on other data, leaves it.
    workdir = tmp_path / "run"
    workdir.mkdir()
    foreign = Path(multi30k_tokenizer.path).read_bytes()
    (workdir / "tokenizer.model").write_bytes(foreign)
    (workdir / "tokenizer.model.old").write_bytes(b"moved aside before")  # not overwritten
    assert train.main(_flags(slice_dir, workdir, "--steps", "4")) == 0
    assert (workdir / "tokenizer.model.old").read_bytes() == b"moved aside before"
    assert (workdir / "tokenizer.model.old.2").read_bytes() == foreign
    trained = (straight_run / "tokenizer.model").read_bytes()  # the same flags and data
    assert (workdir / "tokenizer.model").read_bytes() == trained


def test_an_unwritable_workdir_is_a_one_line_error(slice_dir, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    assert train.main(_flags(slice_dir, tmp_path / "a_file" / "run")) == 2
    err = capsys.readouterr().err
    # As evaluate.py and the shell say it: the path first, then what is wrong with it.
    assert err.startswith(f"error: {tmp_path / 'a_file'}") and err.count("\n") == 1
    assert err.endswith(": Not a directory\n")


def test_a_full_disk_while_the_data_is_set_up_exits_1_as_in_training(
    slice_dir, tmp_path, capsys, monkeypatch
):
    # It exited 2, the status of bad flags or data, where --help says a full disk is 1.
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "cache" / "x.npz"))

    monkeypatch.setattr(train, "load_training_data", full)
    assert train.main(_flags(slice_dir, tmp_path / "run")) == 1
    err = capsys.readouterr().err
    assert err == (
        f"error: {tmp_path / 'cache' / 'x.npz'}: No space left on device; make room there "
        "and run the same command again (training resumes)\n"
    )

    def unreadable(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(slice_dir / "train.en"))

    monkeypatch.setattr(train, "load_training_data", unreadable)
    assert train.main(_flags(slice_dir, tmp_path / "run")) == 2
    assert capsys.readouterr().err == f"error: {slice_dir / 'train.en'}: Permission denied\n"


def test_a_workdir_that_links_to_nothing_is_named_as_a_link(slice_dir, tmp_path, capsys):
    # A runs/ linked to a scratch disk that is not mounted: mkdir said only "File exists".
    (tmp_path / "run").symlink_to(tmp_path / "scratch" / "run")
    assert train.main(_flags(slice_dir, tmp_path / "run")) == 2
    assert capsys.readouterr().err == (
        f"error: --workdir {tmp_path / 'run'} is a link to {tmp_path / 'scratch' / 'run'}, "
        "which is not there: make or mount it, or use another --workdir\n"
    )
    assert not (tmp_path / "scratch").exists()


def test_the_summary_counts_the_validation_lines_scored_for_bleu(slice_dir, tmp_path):
    settings = train.data_settings(_parse(*_flags(slice_dir, tmp_path)), None)
    counts = [(None, "24 lines"), (8, "the first 8 of its 24 lines"), (24, "24 lines")]
    for limit, count in [*counts, (30, "24 lines")]:
        loaded = train.load_training_data(tmp_path, settings, 64, 0, print, limit)
        assert loaded.summary[-1].endswith(f"loss batches, {count} for BLEU")


def test_the_seed_draws_the_order_of_the_training_batches(slice_dir, tmp_path):
    settings = train.data_settings(_parse(*_flags(slice_dir, tmp_path)), None)

    def first_batch(seed):
        loaded = train.load_training_data(tmp_path, settings, 64, seed, print)
        return loaded.batcher.batch_at(0)["src"]

    np.testing.assert_array_equal(first_batch(0), first_batch(0))
    assert not np.array_equal(first_batch(0), first_batch(1))


def test_the_tokenizer_type_flag_chooses_the_tokenizer_trained(slice_dir, tmp_path):
    args = _parse(*_flags(slice_dir, tmp_path, "--tokenizer-type", "unigram"))
    loaded = train.load_training_data(tmp_path, train.data_settings(args, None), 64, 0, print)
    assert loaded.tokenizer.model_type == "unigram"


def test_bleu_sources_stay_aligned_with_the_references_where_cleaning_drops_a_pair(
    slice_dir, tmp_path
):
    # The validation loss skips a one-sided pair; BLEU scores every line against the
    # reference file, so its sources keep that line too.
    data_dir = tmp_path / "data"
    shutil.copytree(slice_dir, data_dir)
    for lang, line in (("en", ""), ("de", "Ein Hund.")):
        lines = (data_dir / f"val.{lang}").read_text(encoding="utf-8").splitlines()
        lines.insert(3, line)
        (data_dir / f"val.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    settings = train.data_settings(_parse(*_flags(data_dir, tmp_path)), None)
    validation = train.load_training_data(tmp_path / "run", settings, 64, 0, print).validation
    assert len(validation.sources) == len(validation.references) == 25
    assert (validation.sources[3], validation.references[3]) == ("", "Ein Hund.")


def test_validation_sentences_longer_than_max_len_are_a_warning_at_the_start(slice_dir, tmp_path):
    # One overlong line ran out of memory at the first validation, with no word before.
    data_dir = tmp_path / "data"
    shutil.copytree(slice_dir, data_dir)
    with open(data_dir / "val.en", "a", encoding="utf-8") as f:
        f.write("a dog runs " * 100 + "\n")
    with open(data_dir / "val.de", "a", encoding="utf-8") as f:
        f.write("ein Hund läuft\n")
    for directory, warned in ((slice_dir, False), (data_dir, True)):
        settings = train.data_settings(_parse(*_flags(directory, tmp_path / "run")), None)
        loaded = train.load_training_data(tmp_path / "run", settings, 128, 0, print)
        warnings = [line for line in loaded.summary if line.startswith("warning: validation")]
        assert len(warnings) == warned
    longest = re.search(
        r"longer than max_len 128 tokens: 1 \(the longest (\d+) tokens\)", *warnings
    )
    assert longest and int(longest[1]) > 128, warnings
    assert loaded.validation is not None  # validated whole, not dropped
    # A sentence of max_len tokens, as long as a training pair may be, is no warning.
    settings = train.data_settings(_parse(*_flags(data_dir, tmp_path / "run")), None)
    loaded = train.load_training_data(tmp_path / "run", settings, int(longest[1]), 0, print)
    assert not [line for line in loaded.summary if line.startswith("warning: validation")]


@pytest.mark.parametrize(
    "max_tokens, max_shapes, over",
    [("1024", "1", 0), ("64", "1", 1), ("900", "12", 2)],
    ids=["within", "over", "some-over"],
)
def test_a_token_budget_below_the_fewest_rows_a_batch_has_is_a_warning(
    slice_dir, tmp_path, max_tokens, max_shapes, over
):
    def loaded_with(budget):
        flags = _flags(slice_dir, tmp_path, "--max-tokens", budget, "--max-shapes", max_shapes)
        loaded = train.load_training_data(
            tmp_path, train.data_settings(_parse(*flags), None), 64, 0, lambda line: None
        )
        return loaded, [line for line in loaded.summary if line.startswith("warning: --max-tokens")]

    loaded, warnings = loaded_with(max_tokens)
    if not over:
        assert warnings == []
        return
    largest = max(r * (s + t) for r, s, t in loaded.batcher.shapes)
    assert largest > int(max_tokens)  # the batches do go over the budget, which the warning says
    (warning,) = warnings
    # The shapes that go over have a batch's fewest rows (8 on one device), also where
    # shorter shapes have more (16 in some-over).
    rows = [r for r, _, _ in loaded.batcher.shapes]
    assert max(rows) == (16 if max_shapes == "12" else 8)
    assert warning.startswith(
        f"warning: --max-tokens {max_tokens} holds fewer than 8 rows of {over} of the {len(rows)}"
    )
    assert warning.endswith(
        f"up to {largest} padded tokens; --max-tokens {largest} or more keeps to it"
    )
    assert loaded_with(str(largest))[1] == []  # the budget it advises is no warning


@pytest.mark.parametrize(
    "error, start",
    [
        (MemoryError("Unable to allocate 35.0 GiB"), "error: out of host memory (Unable to"),
        (
            jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes."),
            "error: out of memory (RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes.)",
        ),
    ],
    ids=["host", "device"],
)
def test_running_out_of_memory_is_one_line_that_names_the_flags(error, start, monkeypatch, capsys):
    def run(args):
        raise error

    monkeypatch.setattr(train, "run", run)
    assert train.main(["--workdir", "unused"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(start) and err.count("\n") == 1, err
    # A resume refuses another --max-tokens or model: the advice must not send one there.
    assert "lower --max-tokens" in err and "in a new --workdir (a resume keeps its" in err


def test_other_errors_are_not_taken_for_running_out_of_memory(monkeypatch):
    def run(args):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(train, "run", run)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        train.main(["--workdir", "unused"])


def test_a_second_run_in_a_workdir_in_use_is_refused_and_writes_nothing(
    slice_dir, tmp_path, capsys
):
    # Before, it trained over the first run's checkpoints, tokenizer and metrics.
    run = tmp_path / "a" / "run"
    with train.workdir_locked(run):  # as the first run holds it
        assert (run / train.LOCK_FILE).read_text() == f"{os.getpid()}\n"
        assert train.main(_flags(slice_dir, run, "--steps", "1")) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: another train.py (process {os.getpid()}) is training in")
        assert err.count("\n") == 1 and str(run) in err
        assert [p.name for p in run.iterdir()] == [train.LOCK_FILE]
    assert not (tmp_path / "a").exists()  # the folders it made, empty again, are removed
    # A lock file that no process holds (a killed run's) does not stop the next run.
    run.mkdir(parents=True)
    (run / train.LOCK_FILE).write_text("999999\n")
    assert train.main(_flags(slice_dir, run, "--steps", "1")) == 0
    assert checkpoint_steps(run) == [1] and not (run / train.LOCK_FILE).exists()


def test_a_file_system_without_locks_trains_with_a_warning(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    run = tmp_path / "run"
    with train.workdir_locked(run):
        assert (run / train.LOCK_FILE).is_file()
    err = capsys.readouterr().err
    assert err == (
        f"warning: cannot lock {run / train.LOCK_FILE} (No locks available); nothing stops a "
        "second run in this workdir\n"
    )
    assert not run.exists()


def test_a_lock_file_the_last_run_removed_as_it_was_locked_is_not_trusted(tmp_path, monkeypatch):
    # A run ending between a new run's open and flock unlinks the file the new run then
    # locks: a third run would make a fresh file, lock it and train beside the second.
    import fcntl

    lock = fcntl.flock
    locked = []

    def flock(file, operation):
        locked.append(os.fstat(file.fileno()).st_ino)
        if len(locked) == 1:
            (tmp_path / train.LOCK_FILE).unlink()  # the run that held it has just ended
        return lock(file, operation)

    (tmp_path / train.LOCK_FILE).write_text("999999\n")
    monkeypatch.setattr(fcntl, "flock", flock)
    with train.workdir_locked(tmp_path):
        assert (tmp_path / train.LOCK_FILE).read_text() == f"{os.getpid()}\n"
        assert locked[-1] == os.stat(tmp_path / train.LOCK_FILE).st_ino and len(locked) == 2


def test_epochs_and_steps_replace_each_other_on_resume():
    # --epochs on a resume of a --steps run replaces the saved steps, which would win.
    saved = {"train": {**train.TRAIN_DEFAULTS, "epochs": None, "steps": 16}}
    config = train.train_config(_parse("--epochs", "5"), saved)
    assert (config.steps, config.epochs) == (None, 5)
    saved = {"train": {**train.TRAIN_DEFAULTS, "epochs": 5, "steps": None}}
    config = train.train_config(_parse("--steps", "30"), saved)
    assert (config.steps, config.epochs) == (30, None)


def test_epochs_train_that_many_passes_over_the_batches(slice_dir, tmp_path, monkeypatch):
    asked = {}

    def recording(settings, model_cfg, loaded, total_steps, *args, **kwargs):
        asked.update(total=total_steps, per_epoch=loaded.batcher.batches_per_epoch)

    monkeypatch.setattr(train, "train_loaded", recording)
    assert train.main(_flags(slice_dir, tmp_path / "run", "--epochs", "3")) == 0
    assert asked["per_epoch"] > 1 and asked["total"] == 3 * asked["per_epoch"]


def test_a_run_prints_the_data_it_trains_on(slice_dir, tmp_path, monkeypatch, capsys):
    # The pairs, the tokenizer, the batch shapes and the validation lines scored: what a
    # user checks before the first steps, and the only word of the budget warnings.
    monkeypatch.setattr(train, "train_loaded", lambda *args, **kwargs: None)
    assert train.main(_flags(slice_dir, tmp_path / "run", "--max-tokens", "64")) == 0
    out = capsys.readouterr().out
    assert "; tokenizer bpe, 400 pieces\n" in out
    assert "data: 1 batch shapes (rows, src, tgt): 8x" in out
    assert "loss batches, 24 lines for BLEU\n" in out
    assert "warning: --max-tokens 64 holds fewer than 8 rows" in out


def test_the_done_line_gives_a_best_validation_bleu_of_zero(
    slice_dir, tmp_path, monkeypatch, capsys
):
    # A short run's greedy BLEU is often 0.00: a score, not "no validation BLEU yet".
    def trained(settings, model_cfg, loaded, total_steps, *args, **kwargs):
        return training.TrainResult(
            step=total_steps, seconds=3.0, interrupted=False, best_bleu=0.0, best_step=4,
            last_loss=5.0, checkpoint_dir=settings.workdir / "checkpoints",
        )  # fmt: skip

    monkeypatch.setattr(train, "train_loaded", trained)
    assert train.main(_flags(slice_dir, tmp_path / "run", "--steps", "4")) == 0
    assert "done: step 4 of 4 in 00:00:03; best validation BLEU 0.00 at step 4; " in (
        capsys.readouterr().out
    )


def test_data_folders_are_saved_as_absolute_paths(tmp_path, monkeypatch):
    # Saved as given, a relative --data-dir would be lost to a resume from another folder.
    monkeypatch.chdir(tmp_path)
    args = _parse("--dataset", "files", "--data-dir", "rel/d", "--tfds-data-dir", "t")
    settings = train.data_settings(args, None)
    assert settings["data_dir"] == str(tmp_path / "rel" / "d")
    assert settings["tfds_data_dir"] == str(tmp_path / "t")


def test_max_len_without_the_flag_is_the_chosen_presets(slice_dir, tmp_path):
    flags = _without_max_len(_flags(slice_dir, tmp_path / "run"))
    assert train.run_settings(_parse(*flags), print).data["max_len"] == 64  # tiny's, not mini's 128
    assert not (tmp_path / "run").exists()


def test_a_refused_run_names_the_process_holding_the_workdir_and_no_other(tmp_path):
    # The file a killed run left held its pid; the next run's was added after it, and a
    # third run's error named both, on two lines.
    (tmp_path / train.LOCK_FILE).write_text("999999\n")
    with train.workdir_locked(tmp_path):
        with pytest.raises(train.UsageError, match=rf"^another train.py \(process {os.getpid()}\)"):
            with train.workdir_locked(tmp_path):
                pass


def test_the_done_line_counts_the_hours_of_a_run_longer_than_a_day():
    assert train._duration(59.9) == "00:00:59"
    assert train._duration(3 * 86400 + 3661) == "73:01:01"  # was 01:01:01


def test_a_ctrl_c_outside_the_stop_handlers_exits_130_with_one_line(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "run", interrupted)
    assert train.main(["--workdir", "unused"]) == 130
    err = capsys.readouterr().err
    assert err.startswith("error: interrupted; run the same command") and err.count("\n") == 1


def test_a_tokenizer_of_other_data_is_moved_aside_while_no_checkpoint_ties_it(tmp_path):
    # A run killed before its first checkpoint, started again on another --data-dir.
    (tmp_path / "tokenizer.model").write_bytes(b"trained on corpus A")
    saved_data = {**train.DATA_DEFAULTS, "dataset": "files", "data_dir": "/corpora/a"}
    now = {**saved_data, "data_dir": "/corpora/b"}
    aside = train.forget_unchecked_tokenizer(tmp_path, {"data": saved_data}, now, print, True)
    assert aside == tmp_path / "tokenizer.model.old"
    assert aside.read_bytes() == b"trained on corpus A"
    assert not (tmp_path / "tokenizer.model").exists()
