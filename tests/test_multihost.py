"""Multi-host training: train.py as two processes joined by jax.distributed on this
machine (one CPU device each, one shared workdir) against one process with two devices.

The global batch is the same, split across hosts instead of across local devices, so
every logged loss and gradient norm must be the same to the last bit (a sum of two
numbers does not depend on which host adds them), through a resume as well.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import data
from transformer.training import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300

# Process 0 of the stale-tokenizer test: train.py with the move of a stale tokenizer held
# back for 3 s, so that a process that does not wait for the move reads the stale file.
SLOW_MOVE = """
import pathlib, runpy, sys, time
replace = pathlib.Path.replace
def slow_replace(self, target):
    if self.name == "tokenizer.model":
        time.sleep(3)
    return replace(self, target)
pathlib.Path.replace = slow_replace
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


def _train(flags, *, processes, devices, slow_move_on_0=False):
    """Runs train.py as `processes` processes of `devices` CPU devices each; all must pass."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    port = _free_port()
    procs = []
    for i in range(processes):
        head = [sys.executable, "train.py"]
        if slow_move_on_0 and i == 0:
            head = [sys.executable, "-c", SLOW_MOVE]
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
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{out[-3000:]}"
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
    workdir = tmp_path / "two_hosts"
    workdir.mkdir()
    spec = data.CorpusSpec(dataset="files", data_dir=str(slice_dir))
    other = [line[::-1] for line in data.load_corpus(spec, "train").src]
    data.train_tokenizer(other, workdir / "tokenizer.model", vocab_size=400)
    stale = (workdir / "tokenizer.model").read_bytes()
    assert stale != (one_host / "tokenizer.model").read_bytes()

    outputs = _train(_flags(slice_dir, workdir, 8), processes=2, devices=1, slow_move_on_0=True)
    assert all("2 cpu device(s) on 2 host(s)" in out for out in outputs)
    assert all("moved to tokenizer.model.old" in out for out in outputs)
    assert (workdir / "tokenizer.model.old").read_bytes() == stale
    assert [r["step"] for r in read_metrics(workdir) if "loss" in r] == [2, 4, 6, 8]
    _train(_flags(slice_dir, workdir, 12), processes=2, devices=1)  # resumes at 8

    expected_train, expected_val = _curve(one_host)
    train, val = _curve(workdir)
    assert [s for s, *_ in expected_train] == [2, 4, 6, 8, 10, 12]
    assert train == expected_train  # exactly: the same global batches and the same sums
    assert val == expected_val and len(val) == 3
    assert (workdir / "tokenizer.model").read_bytes() == (one_host / "tokenizer.model").read_bytes()
