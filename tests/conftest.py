"""Shared fixtures: where the repository and the real Multi30k data are; a private cache root."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# The suite compiles hundreds of small programs and runs each a few times, so XLA's
# optimization passes cost it more than they save: with them off (JAX's
# jax_disable_most_optimizations, read from this variable when JAX is imported, and
# inherited by the processes the tests start) the whole suite took 10m00s instead of
# 12m24s on the 2-core machine, 17m46s of CPU time instead of 22m21s
# (benchmarks/EXPERIMENTS.md, "The test suite's time"). The programs compute the same
# things, rounded in another order at most. `JAX_DISABLE_MOST_OPTIMIZATIONS=0 python -m
# pytest` runs the suite with the full optimization that training and evaluation use.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import transformer.host_memory  # noqa: E402  (imports JAX: after the setting above)

# keep_freed_host_memory() puts every thread of the process on one malloc heap for good,
# which slows compiling (transformer/host_memory.py). The suite compiles hundreds of small
# programs in this one process and times no step, so the calls that train.main and the
# benchmarks make in it change nothing here: tests/test_evaluate.py ran in 58 s instead of
# 70 s. tests/test_host_memory.py checks the setting itself, in processes of its own.
transformer.host_memory.keep_freed_host_memory = lambda: False


# Modules whose tests share what one process builds once: a module-scoped fixture (a trained
# workdir, a model) and the programs their tests compile. pytest-xdist's default scheduling
# spreads a module's tests over the workers, so each built them: test_evaluate.py's trained
# workdir took 22 s on both. These modules run whole on one worker; every other test is
# scheduled on its own, as before (test_multihost.py's one module-scoped fixture serves a
# single test, so its tests stay spread). (`--dist loadgroup` with xdist_group marks was
# made for this, but it passes the group in the test's node id, which pytest 9.2 no longer
# lets a plugin change: pytest-xdist issue #1386.)
MODULES_RUN_WHOLE = frozenset(
    f"tests/test_{name}.py"
    for name in (
        "checkpoints", "data_batching", "decoding", "evaluate", "train_cli", "training",
        "translate",
    )
)  # fmt: skip


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it is loaded
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (pyproject.toml's addopts): MODULES_RUN_WHOLE each as one unit of work, every
    other test as its own; units with the most tests are handed out first."""
    if config.getvalue("dist") != "load":  # another --dist asked for on the command line
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesWholeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in MODULES_RUN_WHOLE else nodeid

    return ModulesWholeScheduling(config, log)


@pytest.fixture
def full_optimization():
    """XLA's full optimization for the test's compilations (the suite's is off, above): for
    tests of what the compiled programs of training and evaluation are made of."""
    import jax

    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    # The setting is not part of the key of JAX's in-memory program caches, so a function
    # that an earlier test compiled with the same shapes would come back unoptimized. The
    # tests that use this fixture compile programs that no other test compiles at their
    # shapes (a review checked, 2026-12-07). Clearing the caches here instead made the three
    # modules that use it take about 40 s more than their 95 s (test_decoding.py's later
    # tests compiled their programs again).
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture
def users_environment() -> dict[str, str]:
    """This process's environment without PYTHONUNBUFFERED, which the development machine
    sets: a user's Python writes a redirected stdout in blocks, so a subprocess test of what
    reaches a file or a pipe, and when, must run without it."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository checkout."""
    return Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def multi30k_dir(repo_root: Path) -> Path:
    """The raw Multi30k files ``{train,val,test2016}.{en,de,fr,cs}``, beside the checkout."""
    return repo_root.parent / "shared" / "data" / "multi30k"


@pytest.fixture
def multi30k_slice(multi30k_dir: Path, tmp_path: Path):
    """A function writing the first ``n`` raw lines of Multi30k files into a folder.

    ``multi30k_slice(n=300, splits=("train", "val"), langs=("en", "de"), out=None)``
    returns the folder (``tmp_path / "multi30k"`` unless ``out`` is given).
    """

    def write(n=300, splits=("train", "val"), langs=("en", "de"), out=None) -> Path:
        out = Path(out) if out is not None else tmp_path / "multi30k"
        out.mkdir(parents=True, exist_ok=True)
        for split in splits:
            for lang in langs:
                lines = (multi30k_dir / f"{split}.{lang}").read_bytes().split(b"\n")[:n]
                (out / f"{split}.{lang}").write_bytes(b"\n".join(lines) + b"\n")
        return out

    return write


@pytest.fixture(scope="session")
def slice_dir(multi30k_dir, tmp_path_factory):
    """The first 300 train and 24 val lines of Multi30k en-de, raw: train.py's end-to-end runs."""
    out = tmp_path_factory.mktemp("multi30k_slice")
    for split, n in (("train", 300), ("val", 24)):
        for lang in ("en", "de"):
            lines = (multi30k_dir / f"{split}.{lang}").read_bytes().split(b"\n")[:n]
            (out / f"{split}.{lang}").write_bytes(b"\n".join(lines) + b"\n")
    return out


@pytest.fixture(scope="session")
def multi30k_tokenizer(multi30k_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The default tokenizer (joint BPE, default size) trained once on full Multi30k en-de train."""
    import data

    corpus = data.load_corpus(data.CorpusSpec(data_dir=str(multi30k_dir)), "train")
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.model"
    return data.train_tokenizer(corpus.src + corpus.tgt, path)


@pytest.fixture(scope="session", autouse=True)
def private_cache_root(tmp_path_factory: pytest.TempPathFactory):
    """The project's caches (compiled programs among them) go to a temporary folder, never
    into ~/.cache, for the whole session; tests that need another root set their own."""
    saved = {
        name: os.environ.get(name) for name in ("TRANSFORMER_MT_CACHE", "JAX_COMPILATION_CACHE_DIR")
    }
    os.environ["TRANSFORMER_MT_CACHE"] = str(tmp_path_factory.mktemp("transformer_mt_cache"))
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def run_ctrl_c_while_loading(repo_root: Path, tmp_path: Path):
    """Runs a command (a script of the repository and its flags) whose first library to
    load, a stand-in numpy, sends it a Ctrl-C while it loads, as a user would."""

    def run(*argv) -> subprocess.CompletedProcess:
        lib = tmp_path / "stand_in_numpy"
        lib.mkdir(exist_ok=True)
        (lib / "numpy.py").write_text(
            "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(60)\n"
        )
        env = dict(os.environ, PYTHONPATH=f"{lib}{os.pathsep}{repo_root}")
        command = [sys.executable, *map(str, argv)]
        return subprocess.run(
            command, cwd=repo_root, env=env, capture_output=True, text=True, timeout=60
        )

    return run
