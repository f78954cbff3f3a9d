"""keep_freed_host_memory: XLA's per-call scratch memory stops being page-faulted in again."""

from __future__ import annotations

import fnmatch
import glob
import importlib.metadata
import importlib.util
import os
import statistics
import subprocess
import sys
import types
from importlib.metadata import EntryPoint
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


@pytest.fixture
def host_memory_module():
    """A private copy of transformer/host_memory.py: conftest.py swaps the suite's
    keep_freed_host_memory for a stand-in, and the copy's names can be faked alone."""
    spec = importlib.util.spec_from_file_location(
        "host_memory_under_test", REPO / "transformer" / "host_memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_glibc_counts_as_glibc(host_memory_module):
    def libc(names, confstr):
        fake = types.SimpleNamespace(confstr=confstr)
        if names is not None:
            fake.confstr_names = names
        host_memory_module.os = fake
        return host_memory_module.uses_glibc()

    def unknown(name):  # os.confstr of a name the platform does not have
        raise ValueError(f"unrecognized configuration name {name}")

    assert libc({"CS_GNU_LIBC_VERSION": 2}, lambda name: "glibc 2.39")
    assert not libc({"CS_PATH": 1}, unknown)  # macOS, musl: no such name
    assert not libc(None, unknown)  # Windows: no confstr at all
    assert not libc({"CS_GNU_LIBC_VERSION": 2}, lambda name: None)  # a name with no value


def test_changes_nothing_outside_glibc(host_memory_module, monkeypatch):
    # mallopt is glibc's: on macOS or musl it is not there to call.
    calls = []
    libc = types.SimpleNamespace(mallopt=lambda *args: calls.append(args) or 1)
    monkeypatch.setattr(host_memory_module.ctypes, "CDLL", lambda name: libc)
    host_memory_module.uses_glibc = lambda: False
    host_memory_module.accelerator_expected = lambda: False
    assert host_memory_module.keep_freed_host_memory() is False
    assert calls == []


@pytest.fixture
def machine(host_memory_module, monkeypatch, tmp_path):
    """accelerator_expected() on a faked machine: `entry_points` names JAX plugins installed
    with an entry point of JAX's group (`jax_plugins`; none in any other group), `namespace`
    those installed as modules of the jax_plugins namespace package, `devices` the device
    nodes present, `libtpu` whether libtpu is installed; nothing else of this machine is
    looked at."""
    import jax

    platforms = jax.config.jax_platforms
    real_exists, real_glob, real_find_spec = os.path.exists, glob.glob, importlib.util.find_spec

    def expected(entry_points=(), namespace=(), devices=(), libtpu=False):
        jax.config.update("jax_platforms", None)

        def plugin_entry_points(group):
            return [EntryPoint(n, f"jax_plugins.{n}", group) for n in entry_points] * (
                group == "jax_plugins"
            )

        monkeypatch.setattr(importlib.metadata, "entry_points", plugin_entry_points)
        package = None
        if namespace:
            folder = tmp_path / "-".join(namespace)
            for name in namespace:
                (folder / name).mkdir(parents=True, exist_ok=True)
                (folder / name / "__init__.py").write_text("")
            package = types.ModuleType("jax_plugins")
            package.__path__ = [str(folder)]
        monkeypatch.setitem(sys.modules, "jax_plugins", package)  # None: no such package
        monkeypatch.setattr(
            os.path, "exists", lambda p: p in devices if p.startswith("/dev/") else real_exists(p)
        )
        monkeypatch.setattr(
            glob,
            "glob",
            lambda pattern: (
                [d for d in devices if fnmatch.fnmatch(d, pattern)]
                if pattern.startswith("/dev/")
                else real_glob(pattern)
            ),
        )
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name: (
                (object() if libtpu else None) if name == "libtpu" else real_find_spec(name)
            ),
        )
        return host_memory_module.accelerator_expected()

    yield expected
    jax.config.update("jax_platforms", platforms)


def test_a_rocm_plugin_is_an_accelerator_with_an_amd_device_only(machine):
    assert machine(entry_points=["xla_rocm7"], devices=["/dev/kfd"])
    assert not machine(entry_points=["xla_rocm7"])
    assert not machine(entry_points=["xla_rocm7"], devices=["/dev/nvidiactl"])
    assert not machine(entry_points=["xla_cuda13"], devices=["/dev/kfd"])


def test_plugins_of_the_jax_plugins_namespace_package_count_too(machine):
    # How JAX finds a plugin installed without an entry point.
    assert machine(namespace=["xla_cuda12"], devices=["/dev/nvidiactl"])
    assert not machine(namespace=["xla_cuda12"])
    assert not machine(namespace=["some_other_plugin"], devices=["/dev/nvidiactl"])


def test_a_tpu_is_an_accelerator_with_libtpu_and_its_device_node(machine):
    assert machine(libtpu=True, devices=["/dev/accel0"])
    assert machine(libtpu=True, devices=["/dev/vfio/0"])  # newer TPU VMs
    assert not machine(libtpu=True, devices=["/dev/vfio/vfio"])  # VFIO's own node
    assert not machine(libtpu=True)
    assert not machine(devices=["/dev/accel0", "/dev/vfio/0"])  # no libtpu: JAX cannot use it
