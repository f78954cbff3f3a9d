"""JAX's persistent compilation cache, so a resumed or repeated run loads its compiled programs.

`train.py` compiles one train-step program per batch shape (12 on Multi30k) and
`evaluate.py` one search program per batch shape. On the 2-core development machine that
is most of the first 107 s of a default run, and on an H100 one step program took 25 to
30 s to compile. JAX can keep compiled programs on disk, keyed by the program, the compile
options, the devices and the JAX and jaxlib versions; with the cache, a resume or the same
command again loads the programs it has seen instead of compiling them (a program holds its
constants, the learning-rate schedule among them, so a run with other `--steps` has its
own). A loaded program is the compiled one, so results do not change.

The cache holds executable code: keep it in a directory only you can write to (the
default is under your home directory).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import jax

# Least recently used programs are deleted beyond this size (a default run's 12 CPU train
# steps take about 12 MB).
MAX_BYTES = 2 * 2**30


def default_cache_dir() -> str:
    """$JAX_COMPILATION_CACHE_DIR if set, else ~/.cache/transformer-mt/xla.

    `$TRANSFORMER_MT_CACHE` replaces ~/.cache/transformer-mt, as for the Multi30k download.
    """
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    root = os.environ.get("TRANSFORMER_MT_CACHE") or os.path.join("~", ".cache", "transformer-mt")
    return os.path.join(os.path.expanduser(root), "xla")


def _set(directory: str | None, max_bytes: int) -> None:
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_compilation_cache_max_size", max_bytes)
    # JAX opens the cache once, at the first compilation that uses it; this makes the next
    # compilation open it at the new directory (or not at all).
    compilation_cache.reset_cache()


EMPTY_CACHE_FLAG = (
    "--compilation-cache is empty: name a folder, leave the flag out for the default, "
    "or use --no-compilation-cache"
)


@contextlib.contextmanager
def persistent_compilation_cache(
    directory: str | os.PathLike | None = None,
    *,
    enabled: bool = True,
    warn: Callable[[str], None] | None = None,
) -> Iterator[Path | None]:
    """Inside the block, compiled programs are read from and written to `directory`.

    Args:
      directory: the cache directory (created if missing); None: `default_cache_dir()`.
      enabled: False for no cache at all (`--no-compilation-cache`).
      warn: called with a one-line message when the directory cannot be created (default:
        printed to stderr); the block then runs without a cache.

    Yields:
      The cache directory in use, or None. On exit the previous setting is restored, so a
      caller in the same process (a test, a notebook) sees no lasting change.
    """
    if directory is not None and os.fspath(directory) == "":
        raise ValueError("the compilation cache directory is empty; pass None for the default")
    previous = (
        jax.config.values["jax_compilation_cache_dir"],
        jax.config.values["jax_compilation_cache_max_size"],
    )
    path = None
    if enabled:
        path = Path(directory if directory is not None else default_cache_dir()).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            (warn or _print_to_stderr)(
                f"warning: cannot use {path} for compiled programs ({e}); compiling without it"
            )
            path = None
    max_bytes = previous[1]
    if max_bytes == -1:  # JAX's default, unbounded; a size set by the caller is kept
        # Eviction locks the cache with `filelock`; without it the cache stays unbounded.
        with contextlib.suppress(ImportError):
            import filelock  # noqa: F401

            max_bytes = MAX_BYTES
    _set(str(path) if path is not None else None, max_bytes)
    try:
        yield path
    finally:
        _set(*previous)


def _print_to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def available_cores() -> int:
    """The CPU cores this process may be scheduled on: its CPU affinity, which a container's
    cpuset narrows. A CPU quota (`docker --cpus`, a Kubernetes limit) does not show here."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def compile_side_by_side(
    lowered: Sequence[jax.stages.Lowered],
    threads: int | None = None,
    *,
    stop: threading.Event | None = None,
) -> list[jax.stages.Compiled | None]:
    """Compiles programs in parallel threads, one program per thread at a time.

    XLA lets go of Python's lock while it compiles, so on a machine with cores to spare the
    programs of a run's batch shapes, compiled side by side, are ready sooner than one after
    another: on a lent H100 with 16 cores, with XLA's autotuning off, the 12 train-step
    programs of a default run took 74.1 s side by side against 264.5 s one by one (README,
    "On a GPU"). On a 2-core CPU it gains nothing: XLA:CPU already spreads one compilation
    over both cores. A program in the persistent cache is loaded instead.

    Args:
      lowered: the programs, from `jax.jit(f).lower(...)` or `jax.pmap(f).lower(...)`.
      threads: most programs compiled at once; default: `available_cores()`.
      stop: once set, no further program is started and this returns at once; the
        compilations under way finish in their threads and are thrown away.

    Returns:
      The compiled programs, in the order of `lowered`; None for each one not compiled
      because `stop` was set.

    Raises:
      Whatever a compilation raised, as soon as it does (the programs not started are
      cancelled).
    """
    if not lowered:
        return []
    threads = max(1, min(threads or available_cores(), len(lowered)))
    pool = ThreadPoolExecutor(threads, thread_name_prefix="compile")
    futures = [pool.submit(program.compile) for program in lowered]
    try:
        pending = set(futures)
        while pending and not (stop is not None and stop.is_set()):
            done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            for future in done:
                future.result()  # a compilation's error, at once
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return [f.result() if f.done() and not f.cancelled() else None for f in futures]
