"""Keep freed host memory in the process, so XLA's CPU steps stop paying for fresh pages.

XLA's CPU runtime allocates each call's scratch buffer (about 190 MB for a training step
of the default model) with `posix_memalign` on one of its worker threads and frees it at
the end of the call. glibc serves a worker thread from a per-thread arena whose heaps are
at most 64 MB, so every such buffer is a fresh `mmap` and every free a `munmap`: each step
then page-faults and zeroes all of its scratch memory again. On the 2-core development
machine a full training run spent 24 min 29 s in the kernel against 70 min 35 s in user
code, and steps 150 to 400 of a 400-step run took 68.0 s against 57.2 s with this module's
settings.

`keep_freed_host_memory()` makes every thread allocate from glibc's main heap, never by
`mmap`, and never trims the heap, so a buffer freed after one step serves the next. The
process keeps its peak host memory instead of returning it between steps. It must run
before the first JAX computation (XLA starts its worker threads then); `train.py` and the
training-step benchmarks call it first thing in `main()`.

One heap has a cost: XLA compiles a program on several threads, which then wait on that
heap's lock. Compiling the 12 step programs of a default run one after another took 54.3
to 63.0 s with it and 43.0 to 47.2 s without (three runs each) on the 2-core machine.
The training steps save far more on the CPU, but decoding does not need it:
`evaluate.py --split test2016` took 39.29 and 39.22 s without it against 42.19 and 42.05 s
with it (alternated, the same output), so it does not call it. A GPU or TPU step keeps its
scratch in the accelerator's memory, so where JAX will run on an accelerator the function
changes nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.util
import os
import pkgutil
from importlib import metadata

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER_TRIM = 2**31 - 1  # the largest value mallopt's int takes


def uses_glibc() -> bool:
    """Whether this process's C library is glibc (not e.g. macOS's or musl)."""
    names = getattr(os, "confstr_names", {})
    return "CS_GNU_LIBC_VERSION" in names and bool(os.confstr("CS_GNU_LIBC_VERSION"))


def accelerator_expected() -> bool:
    """Whether JAX will run on an accelerator, told before JAX starts any backend.

    `jax_platforms` (which JAX reads from `$JAX_PLATFORMS`) decides where set; otherwise,
    whether a JAX plugin for NVIDIA (CUDA) or AMD (ROCm) GPUs, or libtpu, is installed and
    its device is present, which is when JAX picks it by default.
    """
    import jax

    platforms = jax.config.jax_platforms
    if platforms:
        return platforms.split(",")[0].strip() not in ("cpu", "")
    plugins = {entry.name for entry in metadata.entry_points(group="jax_plugins")}
    with contextlib.suppress(ImportError):
        import jax_plugins

        plugins |= {module.name for module in pkgutil.iter_modules(jax_plugins.__path__)}
    devices = {
        "cuda": os.path.exists("/dev/nvidiactl"),
        "rocm": os.path.exists("/dev/kfd"),
    }
    if any(kind in name and present for name in plugins for kind, present in devices.items()):
        return True
    return importlib.util.find_spec("libtpu") is not None and bool(
        glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*")
    )


def keep_freed_host_memory() -> bool:
    """Set glibc's malloc to one arena, no mmap, no trimming; False where that does not apply.

    Returns False (changing nothing) outside glibc, e.g. on macOS or musl, and where JAX
    will run on an accelerator (`accelerator_expected`).
    """
    if not uses_glibc() or accelerator_expected():
        return False
    libc = ctypes.CDLL(None)  # the process's own symbols, glibc's mallopt among them
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)
