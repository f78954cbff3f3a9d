"""Multi-host training: train.py as two processes joined by jax.distributed on this
machine (one CPU device each, one shared workdir) against one process with two devices,
with a SIGTERM to one host in between.

The global batch is the same, split across hosts instead of across local devices, so
every logged loss and gradient norm must be the same to the last bit (a sum of two
numbers does not depend on which host adds them), through a resume as well.
"""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import data
from tests.make_tiny_workdir import damage_checkpoint
from transformer.training import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300

# Process 0 of the two-host test: the move of a stale tokenizer held back for 3 s, so
# that a process that does not wait for the move reads the stale file.
SLOW_MOVE = """
import pathlib, time
replace = pathlib.Path.replace
def slow_replace(self, target):
    if self.name == "tokenizer.model":
        time.sleep(3)
    return replace(self, target)
pathlib.Path.replace = slow_replace
"""
# Process 1 of the two-host test's first run: it looks for a stale tokenizer 6 s late,
# after process 0 would have moved it.
SLOW_LOOK = """
import pathlib, time
is_file = pathlib.Path.is_file
looks = []
def slow_is_file(self):
    if self.name == "tokenizer.model" and not looks:
        looks.append(self)
        time.sleep(6)
    return is_file(self)
pathlib.Path.is_file = slow_is_file
"""
# Process 1 of the two-host test's resume: it sets aside a damaged checkpoint 3 s late.
SLOW_SET_ASIDE = """
import time
from transformer import checkpoints
set_aside = checkpoints.Checkpoints._set_aside
def slow_set_aside(self, step):
    time.sleep(3)
    return set_aside(self, step)
checkpoints.Checkpoints._set_aside = slow_set_aside
"""
# Process 1 of the two-host test: a SIGTERM to itself after step 5, as a scheduler that
# stops one host (or each host at its own moment) sends it.
SIGTERM_AFTER_5 = """
import os, signal
from transformer import training
after_step = training.Trainer._after_step
def after_step_then_signal(self, *args):
    after_step(self, *args)
    if self.step == 5:
        os.kill(os.getpid(), signal.SIGTERM)
training.Trainer._after_step = after_step_then_signal
"""
# Process 1 of the early-stop test: a SIGTERM to itself while the state loads.
SIGTERM_IN_RESTORE = """
import os, signal
from transformer import training
restore_or_init = training.Trainer.restore_or_init
def signal_then_restore(self, *args):
    os.kill(os.getpid(), signal.SIGTERM)
    return restore_or_init(self, *args)
training.Trainer.restore_or_init = signal_then_restore
"""
# Process 1 of the failure test: a disk that fills while step 3's checkpoint is written.
FULL_DISK_AT_3 = """
import errno
from transformer import training
save = training.Trainer.save
def save_unless_step_3(self, **kwargs):
    if self.step == 3:
        raise OSError(errno.ENOSPC, "No space left on device", "checkpoints/3")
    save(self, **kwargs)
training.Trainer.save = save_unless_step_3
"""
# Process 0 of the late-failure test: the disk fills as the run's metrics are closed.
FULL_DISK_AT_THE_END = """
import errno
from transformer import training
close = training.MetricsLog.close
def close_then_fail(self):
    close(self)
    raise OSError(errno.ENOSPC, "No space left on device", "metrics.jsonl")
training.MetricsLog.close = close_then_fail
"""
# train.py's client of JAX's coordination service, wrapped so that one of train.py's own
# calls (by key or barrier name) first does something else (the two preludes below, each
# after this one); Orbax's calls pass through.
_WRAPPED_CLIENT = """
import orbax.checkpoint as ocp
get_client = ocp.multihost.get_jax_distributed_client
class Client:
    def __init__(self, client):
        self._client = client
    def __getattr__(self, name):
        return getattr(self._client, name)
ocp.multihost.get_jax_distributed_client = lambda: Client(get_client())
"""
# Process 1 says so once it has ended its run well, on its way into the barrier where a
# host that ended well waits for the others; process 0 posts its failure only after that.
DONE_KEY = "test/process 1 ended well"
SAYS_IT_ENDED_WELL = f"""
def wait_at_barrier(self, name, timeout_ms, *args, **kwargs):
    if name == "train.py/finished":
        self._client.key_value_set({DONE_KEY!r}, "1")
    return self._client.wait_at_barrier(name, timeout_ms, *args, **kwargs)
Client.wait_at_barrier = wait_at_barrier
"""
FAILS_ONCE_PROCESS_1_ENDED_WELL = f"""
def key_value_set(self, key, value, *args, **kwargs):
    if key == "train.py/failure":
        self._client.blocking_key_value_get({DONE_KEY!r}, 60_000)
    return self._client.key_value_set(key, value, *args, **kwargs)
Client.key_value_set = key_value_set
"""
RUN_TRAIN = """
import runpy, sys
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def _flags(slice_dir, workdir, steps):
    return [
        "--workdir", str(workdir), "--steps", str(steps),
        "--dataset", "files", "--data-dir", str(slice_dir),
        "--preset", "tiny", "--vocab-size", "400", "--max-len", "64",
        "--max-tokens", "1024", "--max-shapes", "1",
        "--warmup-steps", "10", "--lr-scale", "0.5", "--cooldown", "0",
        "--log-every", "2", "--checkpoint-every", "4",
        "--eval-every", "4", "--bleu-every", "0", "--no-progress",
    ]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _train(flags, *, processes, devices, preludes=None, status=0):
    """Runs train.py as `processes` processes of `devices` CPU devices each; all must exit
    with `status` within TIMEOUT_S. preludes: {process: Python code run before train.py}."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    port = _free_port()
    procs = []
    for i in range(processes):
        head = [sys.executable, "train.py"]
        if preludes and i in preludes:
            head = [sys.executable, "-c", preludes[i] + RUN_TRAIN]
        hosts = []
        if processes > 1:
            hosts = [f"--coordinator-address=localhost:{port}", f"--num-processes={processes}"]
            hosts.append(f"--process-id={i}")
        procs.append(
            subprocess.Popen(
                [*head, *flags, *hosts],
                cwd=ROOT,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == status, f"process {i} exited with {p.returncode}:\n{out[-3000:]}"
    return outputs


def _curve(workdir):
    """(step, loss, grad_norm) of every training record and (step, val_loss) of validations."""
    records = read_metrics(workdir)
    train = [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    return train, val


@pytest.fixture(scope="module")
def one_host(slice_dir, tmp_path_factory):
    """12 steps in one process with two devices: the run the two-host runs must repeat."""
    workdir = tmp_path_factory.mktemp("one_host")
    _train(_flags(slice_dir, workdir, 12), processes=1, devices=2)
    return workdir


def test_two_hosts_train_and_resume_as_one_host_with_two_devices(slice_dir, one_host, tmp_path):
    # The workdir starts with a tokenizer left by a run that stopped before its first
    # checkpoint (no config), of the same size and type but trained on other text: no
    # process may use it, even one that reaches the tokenizer while process 0 is still
    # moving it aside (held back 3 s here; before, process 1 read the stale file).
    # Process 1 looks for it late: it must still find it, and both must name the same
    # place (before, it found it moved, or named the next free name). Process 1 alone
    # gets a SIGTERM after step 5: both hosts must stop after one step, save it and exit
    # (before, process 1 went to save while process 0 waited for it in the next step: both
    # hung for ever). The resume finds step 6 damaged and goes on from step 4.
    workdir = tmp_path / "two_hosts"
    workdir.mkdir()
    spec = data.CorpusSpec(dataset="files", data_dir=str(slice_dir))
    other = [line[::-1] for line in data.load_corpus(spec, "train").src]
    data.train_tokenizer(other, workdir / "tokenizer.model", vocab_size=400)
    stale = (workdir / "tokenizer.model").read_bytes()
    assert stale != (one_host / "tokenizer.model").read_bytes()

    preludes = {0: SLOW_MOVE, 1: SLOW_LOOK + SIGTERM_AFTER_5}
    outputs = _train(_flags(slice_dir, workdir, 12), processes=2, devices=1, preludes=preludes)
    assert all("2 cpu device(s) on 2 host(s)" in out for out in outputs)
    # Each says what it waits for: before, process 0 said nothing until process 1 joined.
    assert re.search(
        r"^process 0: coordinating at localhost:\d+; waiting for the other 1 "
        r"process to join \(JAX gives up after 5 minutes\)$",
        outputs[0],
        re.M,
    )
    assert re.search(r"^process 1: waiting for the coordinator at localhost:\d+ ", outputs[1], re.M)
    assert all("moved to tokenizer.model.old" in out for out in outputs)
    assert (workdir / "tokenizer.model.old").read_bytes() == stale
    assert "step 6: another host was asked to stop" in outputs[0]
    assert all("interrupted at step 6; checkpoint saved" in out for out in outputs)
    assert [r["step"] for r in read_metrics(workdir) if "loss" in r] == [2, 4, 6]
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4", "6"]
    damage_checkpoint(workdir / "checkpoints" / "6")
    flags = _flags(slice_dir, workdir, 12)
    outputs = _train(flags, processes=2, devices=1, preludes={1: SLOW_SET_ASIDE})
    assert all("is damaged and was skipped" in out for out in outputs)
    assert all("; kept as 6.damaged;" in out for out in outputs)
    assert all("resumed from step 4" in out for out in outputs)

    expected_train, expected_val = _curve(one_host)
    train, val = _curve(workdir)
    assert [s for s, *_ in expected_train] == [2, 4, 6, 8, 10, 12]
    assert train == expected_train  # exactly: the same global batches and the same sums
    assert val == expected_val and len(val) == 3
    assert (workdir / "tokenizer.model").read_bytes() == (one_host / "tokenizer.model").read_bytes()


def test_a_stop_request_to_one_host_before_training_ends_every_host(slice_dir, tmp_path):
    # Before, process 1 ended alone and process 0 trained on, waiting for it for ever.
    workdir = tmp_path / "run"
    flags = _flags(slice_dir, workdir, 12)
    outputs = _train(flags, processes=2, devices=1, preludes={1: SIGTERM_IN_RESTORE}, status=143)
    assert "SIGTERM: before training starts, then stopping" in outputs[1]
    assert "error: stopped before training started: nothing new" in outputs[1]
    assert "error: stopped before training started: another host was asked to stop" in outputs[0]
    assert not workdir.exists()  # process 0 took back what the run wrote


def test_an_error_on_one_host_ends_every_host_with_its_line(slice_dir, tmp_path):
    # Before, process 1 printed its error and waited 5 minutes for process 0 to shut down,
    # while process 0 waited in step 4 for process 1; then both aborted with a crash report.
    flags = [*_flags(slice_dir, tmp_path / "run", 12), "--checkpoint-every", "3"]
    outputs = _train(flags, processes=2, devices=1, preludes={1: FULL_DISK_AT_3}, status=1)
    line = "checkpoints/3: No space left on device; make room there"
    assert f"error: {line}" in outputs[1]
    assert f"error: process 1: {line}" in outputs[0]


def test_an_error_on_one_host_after_the_others_finished_ends_them_too(slice_dir, tmp_path):
    # Before, process 1 printed "done" and, once process 0 had ended, JAX aborted it with
    # a crash report (-6) that did not say why. Process 0 posts its failure only once
    # process 1 has ended its run: else its post can come first (it did once in .ci/run).
    flags = _flags(slice_dir, tmp_path / "run", 4)
    preludes = {
        0: FULL_DISK_AT_THE_END + _WRAPPED_CLIENT + FAILS_ONCE_PROCESS_1_ENDED_WELL,
        1: _WRAPPED_CLIENT + SAYS_IT_ENDED_WELL,
    }
    outputs = _train(flags, processes=2, devices=1, preludes=preludes, status=1)
    line = "metrics.jsonl: No space left on device; make room there"
    assert "done: step 4 of 4" in outputs[1]
    assert f"error: {line}" in outputs[0]
    assert f"error: process 0: {line}" in outputs[1]
