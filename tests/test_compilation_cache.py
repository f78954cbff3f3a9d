"""The persistent compilation cache: programs compiled in one run are loaded by the next,
with the same results, and the cache leaves no global setting behind."""

import errno
import os
import select
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import evaluate
import train
from tests.make_tiny_workdir import ROOT, tiny_train_flags
from transformer import compilation_cache
from transformer.compilation_cache import (
    compile_side_by_side,
    default_cache_dir,
    persistent_compilation_cache,
)
from transformer.training import read_metrics

CACHE_HIT = "/jax/compilation_cache/cache_hits"


@pytest.fixture
def cache_events():
    """Names of the JAX monitoring events recorded during the test; every program cached."""
    events = []

    def listen(event, **_):
        events.append(event)

    # JAX writes only programs that took 1 s or more to compile; the tests' are faster.
    before = jax.config.values["jax_persistent_cache_min_compile_time_secs"]
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.monitoring.register_event_listener(listen)
    yield events
    # jax.monitoring has unregister_event_listener from JAX 0.7 on; before, its private twin.
    unregister = getattr(jax.monitoring, "unregister_event_listener", None)
    if unregister is None:
        from jax._src import monitoring

        unregister = monitoring._unregister_event_listener_by_callback
    unregister(listen)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def _program(x):
    return jnp.tanh(x @ x.T).sum(axis=0)


def test_a_program_compiled_in_one_block_is_loaded_in_the_next(tmp_path, cache_events):
    x = jnp.arange(12.0).reshape(3, 4)
    setting_before = jax.config.values["jax_compilation_cache_dir"]
    with persistent_compilation_cache(tmp_path / "xla") as path:
        assert path == tmp_path / "xla"
        first = jax.jit(_program)(x)
    assert jax.config.values["jax_compilation_cache_dir"] == setting_before
    assert any(path.iterdir()), "nothing was written to the cache"
    assert CACHE_HIT not in cache_events

    jax.clear_caches()  # as a new process would start: nothing compiled in memory
    with persistent_compilation_cache(tmp_path / "xla"):
        second = jax.jit(_program)(x)
    assert cache_events.count(CACHE_HIT) == 1
    assert jnp.array_equal(first, second)
    # A block with another directory writes there, not into the first block's.
    with persistent_compilation_cache(tmp_path / "other"):
        jax.jit(lambda x: _program(x) * 2)(x)
    assert any((tmp_path / "other").iterdir())


def test_the_cache_is_bounded_inside_the_block_and_a_callers_bound_kept(tmp_path):
    # JAX's default is unbounded (-1); the README promises at most 2 GiB, least recently
    # used programs deleted first. A bound the caller set (0: JAX caches nothing) is kept.
    # After the block the setting is as it was, JAX's default too: set here, since a
    # block that left 2 GiB behind changed `before` for every later test.
    before = jax.config.values["jax_compilation_cache_max_size"]
    try:
        for bound, inside in ((-1, 2 * 2**30), (10**6, 10**6), (0, 0)):
            jax.config.update("jax_compilation_cache_max_size", bound)
            with persistent_compilation_cache(tmp_path / "xla"):
                assert jax.config.values["jax_compilation_cache_max_size"] == inside
            assert jax.config.values["jax_compilation_cache_max_size"] == bound
    finally:
        jax.config.update("jax_compilation_cache_max_size", before)


def test_a_folder_an_unbounded_cache_filled_takes_new_programs(tmp_path, cache_events):
    # Another JAX program's $JAX_COMPILATION_CACHE_DIR, written without a size bound, has
    # no last-use files; the bounded cache read one for every program before each save,
    # so every save failed with a warning and nothing new was kept.
    previous = (jax.config.values["jax_compilation_cache_dir"], -1)
    compilation_cache._set(str(tmp_path / "xla"), -1)
    try:
        jax.jit(_program)(jnp.ones((2, 3)))
    finally:
        compilation_cache._set(*previous)
    written = set((tmp_path / "xla").glob("*-cache"))
    assert written and not list((tmp_path / "xla").glob("*-atime"))

    jax.clear_caches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with persistent_compilation_cache(tmp_path / "xla"):
            jax.jit(lambda x: _program(x) * 3)(jnp.ones((2, 3)))
    assert [str(w.message) for w in caught if "cache" in str(w.message)] == []
    programs = set((tmp_path / "xla").glob("*-cache"))
    assert len(programs) > len(written), "the new program was not saved"
    assert all(p.with_name(p.name[: -len("cache")] + "atime").exists() for p in programs)


def test_without_filelock_programs_are_cached_unbounded(tmp_path, monkeypatch, cache_events):
    # JAX's bounded cache needs filelock: with a bound and no filelock each program's save
    # failed with a warning ("Please install the `filelock` package") and nothing was kept.
    from jax._src import lru_cache

    monkeypatch.setitem(sys.modules, "filelock", None)  # import filelock: ImportError
    monkeypatch.setattr(lru_cache, "filelock", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with persistent_compilation_cache(tmp_path / "xla"):
            assert jax.config.values["jax_compilation_cache_max_size"] == -1
            jax.jit(lambda x: _program(x) * 5)(jnp.ones((2, 3)))
    assert [str(w.message) for w in caught if "cache" in str(w.message)] == []
    assert list((tmp_path / "xla").glob("*-cache"))


def _last_use(path: Path) -> int:
    """The time a `KEY-atime` file holds, as JAX's bounded cache reads it."""
    return int.from_bytes(path.read_bytes(), "little")


def test_a_programs_last_use_is_kept_and_a_missing_one_is_its_files_time(tmp_path):
    # A last use written over would move a program used a moment ago to the front of the
    # eviction queue; one JAX cannot read (big-endian, say) evicts in the wrong order.
    xla = tmp_path / "xla"
    xla.mkdir()
    (xla / "used-cache").write_bytes(b"program")
    (xla / "used-atime").write_bytes((1_800_000_000_000_000_000).to_bytes(8, "little"))
    (xla / "old-cache").write_bytes(b"program")
    mtime_ns = 1_700_000_000_123_456_789
    os.utime(xla / "old-cache", ns=(mtime_ns, mtime_ns))
    with persistent_compilation_cache(xla):
        pass
    assert _last_use(xla / "used-atime") == 1_800_000_000_000_000_000
    assert _last_use(xla / "old-atime") == mtime_ns
    assert sorted(p.name for p in xla.iterdir()) == [
        "old-atime", "old-cache", "used-atime", "used-cache"
    ]  # fmt: skip


def test_a_last_use_that_cannot_be_written_leaves_the_cache_in_use(tmp_path, monkeypatch):
    # A full disk (the write probe's empty file still fits): JAX warns for the program it
    # saves; the block does not fail before it starts.
    (tmp_path / "xla").mkdir()
    (tmp_path / "xla" / "old-cache").write_bytes(b"program")

    def disk_full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_bytes", disk_full)
    with persistent_compilation_cache(tmp_path / "xla") as path:
        assert path == tmp_path / "xla"


def test_disabled_means_no_cache(tmp_path, cache_events):
    jax.clear_caches()
    with persistent_compilation_cache(tmp_path / "xla", enabled=False) as path:
        assert path is None
        assert jax.config.values["jax_compilation_cache_dir"] is None
        jax.jit(_program)(jnp.ones((2, 2)))
    assert CACHE_HIT not in cache_events
    assert not (tmp_path / "xla").exists()


def test_an_unusable_directory_warns_and_compiles_without_a_cache(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    warnings = []
    with persistent_compilation_cache(blocker / "xla", warn=warnings.append) as path:
        assert path is None
        assert jax.config.values["jax_compilation_cache_dir"] is None
        assert jax.jit(_program)(jnp.ones((2, 2))).shape == (2,)
    assert len(warnings) == 1 and str(blocker / "xla") in warnings[0]
    assert "Not a directory" in warnings[0]  # and why it cannot be used


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux's /sys")
def test_a_directory_that_cannot_be_written_to_warns_once(capsys):
    # There and a directory, so it passed; JAX then warned twice for each program compiled.
    warnings = []
    with persistent_compilation_cache("/sys/kernel", warn=warnings.append) as path:
        assert path is None
        assert jax.jit(_program)(jnp.ones((3, 3))).shape == (3,)
    assert len(warnings) == 1 and warnings[0].startswith("warning: cannot use /sys/kernel ")
    assert capsys.readouterr().err == ""


def test_train_py_warns_of_an_unusable_directory_on_stderr_and_trains(
    tmp_path, multi30k_slice, capsys
):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    data_dir = multi30k_slice(n=300, splits=("train", "val"))
    flags = tiny_train_flags(tmp_path / "run", data_dir, steps=1)
    assert train.main([*flags, "--compilation-cache", str(blocker / "xla")]) == 0
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if line.startswith("warning: cannot use")]
    assert len(warnings) == 1 and str(blocker / "xla") in warnings[0]


def test_an_empty_directory_name_is_refused_not_the_current_folder(tmp_path, monkeypatch, capsys):
    # Path("") is "."; the cache's files were written into the folder the command ran in.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="directory is empty"):
        with persistent_compilation_cache(""):
            pass
    with pytest.raises(SystemExit) as exit_:
        train.main(["--workdir", str(tmp_path / "run"), "--compilation-cache", ""])
    assert exit_.value.code == 2
    assert "--compilation-cache is empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_cache_folder_with_no_compilation_cache_is_refused_not_ignored(capsys):
    for parse in (train.build_parser().parse_args, evaluate.parse_args):
        with pytest.raises(SystemExit) as exit_:
            parse(["--workdir", "w", "--compilation-cache", "c", "--no-compilation-cache"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1
        assert "--no-compilation-cache: not allowed with argument --compilation-cache" in err


def test_default_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRANSFORMER_MT_CACHE", str(tmp_path / "root"))
    assert default_cache_dir() == str(tmp_path / "root" / "xla")
    with persistent_compilation_cache() as path:
        assert path == tmp_path / "root" / "xla" and path.is_dir()
    monkeypatch.delenv("TRANSFORMER_MT_CACHE")
    assert default_cache_dir() == str(Path("~/.cache/transformer-mt/xla").expanduser())
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert default_cache_dir() == str(tmp_path / "jax")
    monkeypatch.setenv("TRANSFORMER_MT_CACHE", str(tmp_path / "root"))
    assert default_cache_dir() == str(tmp_path / "jax")  # JAX's own setting wins
    # A quoted or --compilation-cache=~/xla: under the home folder, not a folder named "~".
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with persistent_compilation_cache("~/xla") as path:
        assert path == tmp_path / "home" / "xla" and path.is_dir()


def test_an_empty_cache_variable_is_as_if_unset(monkeypatch, tmp_path):
    # `JAX_COMPILATION_CACHE_DIR= python train.py`, or a variable set from an unset one:
    # "" is the folder the command runs in (TRANSFORMER_MT_CACHE="": a folder "xla" there).
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")
    monkeypatch.setenv("TRANSFORMER_MT_CACHE", "")
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "transformer-mt" / "xla")


def _train_counting_hits(cache_events, flags, cache_flags) -> int:
    """Runs train.py's main as a fresh process would (only the disk cache carries over);
    returns how many programs it loaded from the compilation cache."""
    jax.clear_caches()
    hits_before = cache_events.count(CACHE_HIT)
    assert train.main([*flags, *cache_flags]) == 0
    return cache_events.count(CACHE_HIT) - hits_before


def test_a_second_training_run_loads_the_first_runs_programs_and_repeats_it(
    tmp_path, multi30k_slice, cache_events
):
    data_dir = multi30k_slice(n=300, splits=("train", "val"))
    cache = ["--compilation-cache", str(tmp_path / "xla")]
    first, second = tmp_path / "first", tmp_path / "second"
    assert (
        _train_counting_hits(cache_events, tiny_train_flags(first, data_dir, steps=3), cache) == 0
    )
    # the train step (at least) came from the cache
    assert (
        _train_counting_hits(cache_events, tiny_train_flags(second, data_dir, steps=3), cache) > 0
    )
    # Loaded programs are the compiled ones: the same losses to the last digit.
    losses = [[record["loss"] for record in read_metrics(run)] for run in (first, second)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_a_resume_loads_the_programs_its_run_compiled_and_trains_as_one_run(
    tmp_path, multi30k_slice, cache_events
):
    # README: "A resume, or the same command again, loads those programs". With --cooldown 0
    # the schedule does not hold --steps, so going on to step 4 runs the 2-step run's program.
    data_dir = multi30k_slice(n=300, splits=("train", "val"))
    cache = ["--compilation-cache", str(tmp_path / "xla")]

    def run(workdir, steps, cache_flags):
        flags = [*tiny_train_flags(workdir, data_dir, steps=steps), "--cooldown", "0"]
        return _train_counting_hits(cache_events, flags, cache_flags)

    assert run(tmp_path / "run", 2, cache) == 0
    assert run(tmp_path / "run", 4, cache) > 0
    assert run(tmp_path / "whole", 4, ["--no-compilation-cache"]) == 0
    losses = [
        {r["step"]: r["loss"] for r in read_metrics(w) if "loss" in r}
        for w in (tmp_path / "run", tmp_path / "whole")
    ]
    assert sorted(losses[0]) == [1, 2, 3, 4] and losses[0] == losses[1]


def test_no_compilation_cache_flag_writes_nothing(tmp_path, multi30k_slice, monkeypatch):
    monkeypatch.setenv("TRANSFORMER_MT_CACHE", str(tmp_path / "root"))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    data_dir = multi30k_slice(n=300, splits=("train", "val"))
    flags = tiny_train_flags(tmp_path / "run", data_dir, steps=1)
    assert train.main([*flags, "--no-compilation-cache"]) == 0
    assert not (tmp_path / "root" / "xla").exists()


class _Program:
    """Stands in for a `jax.stages.Lowered`. `log` gets ("lowered", "started" or "finished",
    name, thread name) as `lower` and `compile` run. compile() calls `on_start`, waits for
    `release` and then for `barrier`, where given, and returns or raises `error`."""

    def __init__(self, name, log, *, release=None, barrier=None, error=None, on_start=None):
        self.name, self.log, self.error, self.on_start = name, log, error, on_start
        self.release, self.barrier = release, barrier

    def lower(self):
        self.log.append(("lowered", self.name, threading.current_thread().name))
        return self

    def compile(self):
        self.log.append(("started", self.name, threading.current_thread().name))
        if self.on_start is not None:
            self.on_start()
        if self.release is not None:
            self.release.wait(timeout=60)
        if self.barrier is not None:
            self.barrier.wait(timeout=30)  # BrokenBarrierError unless all compile at once
        self.log.append(("finished", self.name, threading.current_thread().name))
        if self.error is not None:
            raise self.error
        return f"compiled {self.name}"


def _lowerings(programs):
    return [program.lower for program in programs]


def _logged(log, what):
    return [name for logged, name, _ in log if logged == what]


def _join_compile_threads():
    for worker in compilation_cache._WORKERS:
        worker.join(timeout=60)


def test_side_by_side_returns_every_program_in_order_and_in_parallel():
    log, all_four = [], threading.Barrier(4)
    programs = [_Program(i, log, barrier=all_four) for i in range(4)]
    compiled = compile_side_by_side(_lowerings(programs), threads=4)
    assert compiled == [f"compiled {i}" for i in range(4)]  # each passed the barrier: at once
    # Lowered here, one by one (tracing holds Python's lock); compiled in the threads.
    lowered = [(name, thread) for what, name, thread in log if what == "lowered"]
    assert lowered == [(i, threading.current_thread().name) for i in range(4)]
    assert all(thread.startswith("compile-") for what, _, thread in log if what == "started")


def test_a_stop_request_ends_side_by_side_compiling_without_waiting_for_the_rest():
    stop, release, log = threading.Event(), threading.Event(), []

    def stop_once_two_compile():
        if {1, 2} <= set(_logged(log, "started")):
            stop.set()

    programs = [_Program(0, log)]
    programs += [
        _Program(i, log, release=release, on_start=stop_once_two_compile) for i in (1, 2, 3)
    ]
    try:
        results = compile_side_by_side(_lowerings(programs), threads=2, stop=stop)
        assert results == ["compiled 0", None, None, None]
        assert _logged(log, "finished") == [0]  # returned while 1 and 2 were compiling
    finally:
        release.set()
    _join_compile_threads()
    assert _logged(log, "started") == [0, 1, 2]  # none started after the stop


def test_a_stop_before_the_start_lowers_and_compiles_nothing():
    # Before, a pool took every program at once, and 2 threads started 2 of them.
    stop, log = threading.Event(), []
    stop.set()
    programs = [_Program(i, log) for i in range(3)]
    assert compile_side_by_side(_lowerings(programs), threads=2, stop=stop) == [None] * 3
    _join_compile_threads()
    assert log == []


def test_a_compile_error_is_raised_at_once_and_no_program_starts_after_it():
    release, log = threading.Event(), []
    programs = [_Program(0, log, release=release), _Program(1, log, error=ValueError("bad"))]
    programs += [_Program(i, log) for i in (2, 3, 4)]
    try:
        with pytest.raises(ValueError, match="bad"):
            compile_side_by_side(_lowerings(programs), threads=2)
        assert _logged(log, "finished") == [1]  # raised while 0 was compiling
    finally:
        release.set()
    _join_compile_threads()
    assert _logged(log, "started") == [0, 1]


def test_no_more_programs_compile_at_once_than_threads_and_the_threads_end():
    log, lock, running, most = [], threading.Lock(), [0], [0]

    def counted(program):
        compile_program = program.compile

        def compile():
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.05)
            with lock:
                running[0] -= 1
            return compile_program()

        program.compile = compile
        return program

    programs = [counted(_Program(i, log)) for i in range(6)]
    compiled = compile_side_by_side(_lowerings(programs), threads=2)
    assert compiled == [f"compiled {i}" for i in range(6)] and most[0] <= 2
    assert {thread for what, _, thread in log if what == "started"} <= {"compile-1", "compile-2"}
    _join_compile_threads()
    assert not any(worker.is_alive() for worker in compilation_cache._WORKERS)
    # Python's exit joins the threads on record, which stay those of the last call, not
    # every thread a long run has started.
    assert compile_side_by_side(_lowerings(programs[:2]), threads=2)[1] == "compiled 1"
    assert len(compilation_cache._WORKERS) == 2


def test_available_cores_are_the_processs_affinity_not_the_machines(monkeypatch):
    # A container's cpuset: 1 core of 16, and 16 threads would each slow the others.
    monkeypatch.setattr(compilation_cache.os, "sched_getaffinity", lambda pid: {3})
    monkeypatch.setattr(compilation_cache.os, "cpu_count", lambda: 16)
    assert compilation_cache.available_cores() == 1


def test_by_default_as_many_programs_compile_at_once_as_there_are_cores(monkeypatch):
    monkeypatch.setattr(compilation_cache, "available_cores", lambda: 3)
    log, all_three = [], threading.Barrier(3)
    programs = [_Program(i, log, barrier=all_three) for i in range(3)]
    assert compile_side_by_side(_lowerings(programs)) == [f"compiled {i}" for i in range(3)]
    _join_compile_threads()


def _wait_until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_stop_while_lowering_starts_no_program_waiting_for_a_thread():
    # A stop request comes (a signal handler runs on this thread) while the third program
    # is lowered, and the one thread then finishes the first: the second, queued for it,
    # must not start.
    stop, release, log = threading.Event(), threading.Event(), []
    programs = [_Program(0, log, release=release), _Program(1, log), _Program(2, log)]

    def lower_with_a_stop():
        stop.set()
        release.set()
        worker = compilation_cache._WORKERS[-1]
        _wait_until(lambda: not worker.is_alive() or 1 in _logged(log, "started"))
        return programs[2].lower()

    lowerings = [*_lowerings(programs[:2]), lower_with_a_stop]
    assert compile_side_by_side(lowerings, threads=1, stop=stop) == ["compiled 0", None, None]
    _join_compile_threads()
    assert _logged(log, "started") == [0]


class _StopSeenOnceFinished:
    """A stop request that the calling thread sees set from its second look on, once
    program `name` has finished compiling: the threads never see it."""

    def __init__(self, name, log):
        self.name, self.log, self.looks = name, log, 0
        self.caller = threading.current_thread()

    def is_set(self):
        if threading.current_thread() is not self.caller:
            return False
        self.looks += 1
        if self.looks == 1:
            return False
        _wait_until(lambda: self.name in _logged(self.log, "finished"))
        time.sleep(0.1)  # its result is queued just after
        return True


@pytest.mark.parametrize("error", [None, ValueError("bad")], ids=["compiled", "failed"])
def test_a_program_done_when_the_stop_is_seen_is_kept_and_its_error_raised(error):
    # A stop seen while waiting for the last program, which has just finished: it is
    # returned compiled (a stop threw it away), and its error is raised, not lost.
    release, log = threading.Event(), []
    threading.Timer(0.3, release.set).start()  # done after the lowering loop's last look
    lowerings = _lowerings([_Program(0, log, release=release, error=error)])
    stop = _StopSeenOnceFinished(0, log)
    if error is None:
        assert compile_side_by_side(lowerings, threads=1, stop=stop) == ["compiled 0"]
    else:
        with pytest.raises(ValueError, match="bad"):
            compile_side_by_side(lowerings, threads=1, stop=stop)
    _join_compile_threads()


def test_a_ctrl_c_while_lowering_starts_no_program_queued_before_it():
    release, log = threading.Event(), []
    programs = [_Program(0, log, release=release), _Program(1, log)]

    def interrupted():
        _wait_until(lambda: 0 in _logged(log, "started"))
        raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            compile_side_by_side([*_lowerings(programs), interrupted], threads=1)
    finally:
        release.set()
    _join_compile_threads()
    assert _logged(log, "started") == [0]


def test_several_hosts_keep_pythons_exit(monkeypatch):
    # os._exit on one host of several leaves JAX's coordination service out of step.
    monkeypatch.setattr(compilation_cache, "_THREADS_ABANDONED", threading.Event())
    compilation_cache.abandon_threads_at_exit()
    assert compilation_cache._exits_at_once()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert not compilation_cache._exits_at_once()


@pytest.mark.parametrize(
    "raised, status, err",
    [
        (KeyboardInterrupt(), 130, "KeyboardInterrupt"),
        (ValueError("x"), 1, "ValueError: x"),
        (SystemExit(2), 2, ""),
        (SystemExit("error: a line"), 1, "error: a line"),
        (SystemExit(None), 0, ""),
    ],
)
def test_exiting_at_once_keeps_the_status_python_would_give(
    monkeypatch, capsys, raised, status, err
):
    exits = []

    def os_exit(code):
        exits.append(code)
        raise SystemExit  # os._exit would end the test's process

    def main():
        raise raised

    monkeypatch.setattr(compilation_cache, "_exits_at_once", lambda: True)
    monkeypatch.setattr(compilation_cache.os, "_exit", os_exit)
    with pytest.raises(SystemExit):
        compilation_cache.exit_process(main)
    assert exits == [status] and err in capsys.readouterr().err


def test_with_nothing_compiling_what_main_raises_goes_on_to_python(monkeypatch):
    # Python's own exit then ends the process: a KeyboardInterrupt as a death by SIGINT,
    # which stops a shell script that runs the command, and a caller sees the exception.
    monkeypatch.setattr(compilation_cache, "_exits_at_once", lambda: False)

    def main():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compilation_cache.exit_process(main)


def test_exiting_at_once_keeps_what_was_printed(users_environment):
    # os._exit drops what Python still buffers: a pipe's stdout is written in blocks, and
    # stderr a line at a time, so a line without its end was lost.
    code = (
        "import sys\n"
        "from transformer.compilation_cache import abandon_threads_at_exit, exit_process\n"
        "def main():\n"
        "    print('a line')\n"
        "    print('a line without its end', end='', file=sys.stderr)\n"
        "    abandon_threads_at_exit()\n"
        "    return 3\n"
        "exit_process(main)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=users_environment,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stdout == "a line\n" and done.stderr.endswith("a line without its end")


def test_a_command_writes_its_stdout_to_a_pipe_a_line_at_a_time(users_environment):
    # Written in 8 KiB blocks, `python train.py > train.log` showed no line of the log
    # until the run ended. This command prints a line, then waits for its stdin to close.
    code = (
        "import sys\n"
        "from transformer.compilation_cache import exit_process\n"
        "def main():\n"
        "    print('a line')\n"
        "    return len(sys.stdin.read())\n"
        "exit_process(main)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=users_environment,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        readable = select.select([process.stdout], [], [], 60)[0]
        assert readable, "no line within 60 s of the command running"
        assert process.stdout.readline() == b"a line\n"
        assert process.poll() is None  # it arrived while the command was still running
    finally:
        process.stdin.close()
        if process.wait(timeout=60) != 0:
            raise AssertionError(process.stderr.read().decode())


# Its compile() takes a second and then writes the file named by the first argument.
WAITS_FOR_A_COMPILATION = """
import sys, threading, time
from transformer.compilation_cache import compile_side_by_side
class Slow:
    def compile(self):
        time.sleep(1.0)
        open(sys.argv[1], "w").close()
        return "compiled"
stop = threading.Event()
def lower():
    threading.Timer(0.2, stop.set).start()
    return Slow()
assert compile_side_by_side([lower], stop=stop) == [None]
"""


def test_a_plain_python_exit_waits_for_a_compilation_under_way(tmp_path):
    # Without exit_process, Python's exit must wait for it: XLA aborts a process that ends
    # under a compiling thread.
    done = subprocess.run(
        [sys.executable, "-c", WAITS_FOR_A_COMPILATION, str(tmp_path / "compiled")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "compiled").exists()


# A program that takes about 15 s to compile on the 2-core development machine. Its
# compile() sets `compiling` as it starts and writes the file named by the first argument
# once it ends.
SLOW_PROGRAM = """
import sys, threading
import jax, jax.numpy as jnp
from transformer.compilation_cache import compile_side_by_side, exit_process
def f(x):
    for i in range(1000):
        x = jnp.sin(x) @ x.T + jnp.cos(x * i)
        x = x[:, ::-1] + jnp.roll(x, i % 7, axis=0)
    return x
compiling = threading.Event()
class Marked:
    def __init__(self, lowered):
        self.lowered = lowered
    def compile(self):
        compiling.set()
        compiled = self.lowered.compile()
        open(sys.argv[1], "w").close()
        return compiled
def slow():
    return Marked(jax.jit(f).lower(jax.ShapeDtypeStruct((64, 64), jnp.float32)))
def bad():
    compiling.wait()
    raise ValueError("bad lowering")
"""


@pytest.mark.parametrize(
    "main, status, err",
    [
        (  # a stop request: main returns its status
            "stop = threading.Event()\n"
            "threading.Thread(target=lambda: (compiling.wait(), stop.set()), daemon=True).start()\n"
            "def main():\n"
            "    return 3 if compile_side_by_side([slow], stop=stop) == [None] else 0\n",
            3,
            "",
        ),
        (  # an error: main raises, and its traceback is printed as Python prints it
            "def main():\n    compile_side_by_side([slow, bad])\n",
            1,
            "ValueError: bad lowering",
        ),
    ],
)
def test_exit_process_does_not_wait_for_a_compilation_under_way(main, status, err, tmp_path):
    # Python's exit waits for it, and before, an error with one under way aborted the
    # process (exit 134: "terminate called after throwing an instance of ''").
    code = SLOW_PROGRAM + main + "exit_process(main)\n"
    compiled = tmp_path / "compiled"
    done = subprocess.run(
        [sys.executable, "-c", code, str(compiled)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == status, done.stderr
    assert err in done.stderr and "terminate called" not in done.stderr
    assert not compiled.exists()  # the process ended while the program was compiling
