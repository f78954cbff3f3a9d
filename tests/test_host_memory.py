"""keep_freed_host_memory: XLA's per-call scratch memory stops being page-faulted in again."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from transformer.host_memory import uses_glibc

REPO = Path(__file__).resolve().parents[1]
glibc = pytest.mark.skipif(not uses_glibc(), reason="needs glibc")

# A jitted function whose scratch (3000 x 3000 float32 intermediates, 36 MB each) is far
# above glibc's per-thread heap; prints the minor page faults of each of 30 calls after a
# warm-up.
SCRIPT = """
import resource, sys
from transformer.host_memory import keep_freed_host_memory
if sys.argv[1] == "keep":
    assert keep_freed_host_memory()
import jax, jax.numpy as jnp

@jax.jit
def f(x):
    y = jnp.tanh(x @ x.T)
    return (jnp.exp(y) * y + jnp.sin(y)).sum()

x = jnp.ones((3000, 32))
for _ in range(3):
    f(x).block_until_ready()
for _ in range(30):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults_per_call(mode: str) -> float:
    """The median over 30 calls of one call's minor page faults, in a fresh process.

    The median, since with freed memory kept the heap still grows by a whole scratch
    buffer now and then, at random calls, before it holds enough room: a call that grows
    it faults as many pages as a call without the setting. In 20 processes here 0 to 4 of
    the 30 calls did, and the other calls faulted none; over 10 calls, the test's first
    length, it failed about once in a dozen runs.
    """
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
    )
    return statistics.median(int(line) for line in out.stdout.split())


@glibc
def test_scratch_memory_is_reused_instead_of_faulted_in_every_call():
    default = _faults_per_call("default")
    kept = _faults_per_call("keep")
    # Without it every call touches ~70 MB of fresh pages (~18k faults on the development
    # machine); with it the median call had 0 there.
    assert default > 8000, f"median faults per call without the setting: {default}"
    assert kept < default / 2, f"median faults per call: {kept} kept, {default} without"


@glibc
def test_applies_on_glibc():
    # In a process of its own: the suite's process leaves the setting off (conftest.py).
    # glibc's mallopt(3), each call recorded: one heap for every thread (M_ARENA_MAX -8),
    # none of it from mmap (M_MMAP_MAX -4), never given back (M_TRIM_THRESHOLD -1).
    script = (
        "import ctypes\n"
        "from transformer import host_memory\n"
        "libc, calls = ctypes.CDLL(None), []\n"
        "class Recording:\n"
        "    def mallopt(self, param, value):\n"
        "        calls.append((param, value))\n"
        "        return libc.mallopt(param, value)\n"
        "host_memory.ctypes.CDLL = lambda name: Recording()\n"
        "print(host_memory.keep_freed_host_memory(), sorted(calls))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == "True [(-8, 1), (-4, 0), (-1, 2147483647)]\n"


# Prints keep_freed_host_memory()'s answer on a faked machine, whatever this one has:
# argv[1] "gpu" an installed CUDA plugin (an entry point of JAX's plugin group), else none;
# argv[2] "device" a present NVIDIA device node, else none; no TPU.
DECIDE = """
import importlib.util, os, sys
from importlib import metadata
from transformer import host_memory

plugins = [metadata.EntryPoint("xla_cuda13", "jax_plugins.xla_cuda13", "jax_plugins")]
host_memory.metadata.entry_points = lambda group: plugins if sys.argv[1] == "gpu" else []
sys.modules["jax_plugins"] = None  # no namespace plugins: importing it fails
real_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name: None if name == "libtpu" else real_find_spec(name)
real_exists = os.path.exists


def exists(path):
    return sys.argv[2] == "device" if path == "/dev/nvidiactl" else real_exists(path)


os.path.exists = exists
print(host_memory.keep_freed_host_memory())
"""


def _decides(*argv: str, platforms: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if platforms is not None:
        env["JAX_PLATFORMS"] = platforms
    out = subprocess.run(
        [sys.executable, "-c", DECIDE, *argv],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@glibc
def test_changes_nothing_where_jax_will_run_on_an_accelerator():
    """An accelerator's steps keep their scratch on the device, and one heap slows compiling."""
    assert _decides("none", "none", platforms="cuda") == "False"
    assert _decides("none", "none", platforms="tpu,cpu") == "False"
    assert _decides("gpu", "device") == "False"  # JAX's default choice: the GPU
    assert _decides("gpu", "device", platforms="cpu") == "True"
    # A CUDA plugin on a machine without an NVIDIA device runs on the CPU.
    assert _decides("gpu", "none") == "True"
    assert _decides("none", "device") == "True"
