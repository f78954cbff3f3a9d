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

import atexit
import contextlib
import os
import queue
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn

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
      warn: called with a one-line message when the directory cannot be created or
        written to (default: printed to stderr); the block then runs without a cache.

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
            # A folder there that this user cannot write to: JAX would warn twice for each
            # program it compiled.
            with tempfile.TemporaryFile(dir=path):
                pass
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
    if path is not None and max_bytes != -1:
        _give_entries_a_last_use(path)
    _set(str(path) if path is not None else None, max_bytes)
    try:
        yield path
    finally:
        _set(*previous)


def _give_entries_a_last_use(path: Path) -> None:
    """Writes a last-use time beside each program that has none, so a bounded cache can use
    a folder an unbounded one filled (another JAX program's `$JAX_COMPILATION_CACHE_DIR`).

    A bounded cache keeps `KEY-atime` (the last use, nanoseconds, 8 bytes little-endian)
    beside each `KEY-cache` and reads every one before it saves a program; one missing made
    every save fail with a warning. The program file's modification time stands in.
    """
    try:
        for program in path.glob("*-cache"):
            atime = program.with_name(program.name.removesuffix("-cache") + "-atime")
            if not atime.exists():
                atime.write_bytes(program.stat().st_mtime_ns.to_bytes(8, "little"))
    except OSError:
        pass  # another process's eviction, say; JAX then warns for the program it saves


def _print_to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def available_cores() -> int:
    """The CPU cores this process may be scheduled on: its CPU affinity, which a container's
    cpuset narrows. A CPU quota (`docker --cpus`, a Kubernetes limit) does not show here."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# The threads `compile_side_by_side` started: a compilation under way cannot be stopped, so
# after a stop or an error they may still be compiling, which `exit_process` looks at.
_WORKERS: list[threading.Thread] = []


def compile_side_by_side(
    lowerings: Sequence[Callable[[], jax.stages.Lowered]],
    threads: int | None = None,
    *,
    stop: threading.Event | None = None,
) -> list[jax.stages.Compiled | None]:
    """Lowers programs one by one on this thread and compiles them in parallel threads.

    XLA lets go of Python's lock while it compiles, so on a machine with cores to spare the
    programs of a run's batch shapes, compiled side by side, are ready sooner than one after
    another: on a lent H100 with 16 cores, with XLA's autotuning off, the 12 train-step
    programs of a default run took 74.1 s side by side against 264.5 s one by one (README,
    "On a GPU"). On a 2-core CPU it gains nothing: XLA:CPU already spreads one compilation
    over both cores. Lowering (tracing the function) holds Python's lock, so it is done
    here, each program's while the threads compile the ones before. A program in the
    persistent cache is loaded instead of compiled.

    Args:
      lowerings: functions that each lower one program, such as `lambda:
        jax.jit(f).lower(x)`.
      threads: most programs compiled at once; default: `available_cores()`.
      stop: once set, no further program is lowered or started and this returns at once.

    Returns:
      The compiled programs, in the order of `lowerings`; None for each one not compiled
      because `stop` was set.

    Raises:
      Whatever a lowering or a compilation raised, once this thread sees it (after the
      lowering under way); no program starts after it, nor after a KeyboardInterrupt
      here. Compilations under way go on in their threads, which XLA cannot stop, and are
      thrown away. Python's exit waits for them (tearing the process down under one
      aborts it); `exit_process` does not.
    """
    stopped = lambda: stop is not None and stop.is_set()  # noqa: E731
    results: list[jax.stages.Compiled | None] = [None] * len(lowerings)
    threads = max(1, min(threads or available_cores(), len(lowerings)))
    work: queue.SimpleQueue = queue.SimpleQueue()  # (index, lowered); None ends a thread
    done: queue.SimpleQueue = queue.SimpleQueue()  # (index, compiled, error)
    over = threading.Event()  # set by an error or the return: no program starts after it

    def compile_each() -> None:
        while (item := work.get()) is not None and not over.is_set() and not stopped():
            index, lowered = item
            try:
                done.put((index, lowered.compile(), None))
            except BaseException as e:  # raised in the calling thread
                over.set()
                done.put((index, None, e))

    def collect(wait: float) -> bool:
        """Takes one finished compilation, waiting up to `wait` s; False if none came."""
        try:
            index, compiled, error = done.get(timeout=wait) if wait else done.get_nowait()
        except queue.Empty:
            return False
        if error is not None:
            raise error
        results[index] = compiled
        return True

    _WORKERS[:] = [worker for worker in _WORKERS if worker.is_alive()]
    workers: list[threading.Thread] = []
    submitted = collected = 0
    try:
        for index, lower in enumerate(lowerings):
            if stopped() or over.is_set():
                break
            work.put((index, lower()))
            submitted += 1
            if len(workers) < threads:
                name = f"compile-{len(workers) + 1}"
                worker = threading.Thread(target=compile_each, name=name, daemon=True)
                workers.append(worker)
                _WORKERS.append(worker)
                worker.start()
            while collect(0):
                collected += 1
        while collected < submitted and not stopped():
            collected += collect(0.25)
        while collect(0):  # those done by now, and an error that came with a stop
            pass
    finally:
        over.set()
        for _ in workers:
            work.put(None)
    return results


_THREADS_ABANDONED = threading.Event()


def abandon_threads_at_exit() -> None:
    """Makes `exit_process` skip Python's exit (with one host), which would wait forever for
    threads that will not end: Orbax's, after a failed checkpoint write, each waiting for a
    signal from a part of the save that never started."""
    _THREADS_ABANDONED.set()


def _exits_at_once() -> bool:
    """Whether `exit_process` skips Python's exit: a compilation runs or threads were
    abandoned, and one host."""
    compiling = any(worker.is_alive() for worker in _WORKERS)
    return (compiling or _THREADS_ABANDONED.is_set()) and jax.process_count() == 1


@atexit.register  # after JAX's own exit handler is registered, so before it runs
def _wait_for_compilations() -> None:
    for worker in _WORKERS:
        worker.join()


def exit_process(main: Callable[[], int]) -> NoReturn:
    """Runs a command's `main` and exits with its status, at once where a compilation is
    still under way or threads were abandoned (`abandon_threads_at_exit`).

    After a stop request or an error, `compile_side_by_side` returns without waiting for
    the compilations under way, which XLA cannot stop (on a GPU one can take half a
    minute). Python's exit would wait for them, so this one, with one host, skips it
    (`os._exit`, after flushing stdout and stderr; `main` has closed its files). What
    `main` raises is then printed as Python prints it, with status 1 (130 for a
    KeyboardInterrupt). With several hosts Python's exit is kept, which leaves JAX's
    coordination service in step with the other hosts.

    Stdout is line-buffered first: to a file or a pipe (`python train.py > train.log`,
    `| tee`) Python writes it in blocks of 8 KiB, so `tail -f` showed none of an hour's
    log until the run ended, and a run killed (out of memory) lost its last lines.
    """
    if hasattr(sys.stdout, "reconfigure"):  # not where it is None or a caller's own stream
        sys.stdout.reconfigure(line_buffering=True)
    try:
        status = main()
    except BaseException as e:
        if not _exits_at_once():
            raise
        if isinstance(e, SystemExit):
            status = e.code if isinstance(e.code, int) else int(e.code is not None)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        else:
            traceback.print_exception(e)
            status = 130 if isinstance(e, KeyboardInterrupt) else 1
    if _exits_at_once():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
