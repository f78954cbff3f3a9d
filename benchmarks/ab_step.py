"""A/B timing of the train step between two revisions of this repository, in one process.

    python benchmarks/ab_step.py HEAD~1 HEAD
    python benchmarks/ab_step.py fc7bec1 WORKTREE --rounds 40 --preset mini

Each revision's files (`git archive REV`; WORKTREE means the checkout as it is
now) are imported under a fresh module table, and its pmapped train step is
built and compiled by its own `benchmarks/train_speed.make_step_inputs` at one
fixed shape (train_speed's default: 64 sentences x (16 + 16) tokens). Then each
round runs one step of every revision, in an order that alternates between
rounds, and the median per revision is printed with their ratio. Alternating in
one process puts both under the same machine noise: on a shared machine,
timings taken minutes apart differ by more than most changes being measured.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[1]
WORKTREE = "WORKTREE"
# Top-level names a revision's step is built from; dropped between revisions.
_OWN_MODULES = ("benchmarks", "data", "train", "transformer")


def export_revision(revision: str, into: Path, position: int) -> Path:
    """The folder holding `revision`'s files: the checkout itself for WORKTREE.

    Args:
      revision: a git revision, or WORKTREE.
      into: the folder to export into.
      position: the revision's place on the command line, which names its
        folder, so that a revision compared with itself (to measure the
        noise) gets a folder of its own each time.

    Returns:
      `into / "{position}_{revision}"` (slashes in the revision made "_"), or the
      checkout for WORKTREE.
    """
    if revision == WORKTREE:
        return REPO
    folder = into / f"{position}_{revision.replace('/', '_')}"
    folder.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", revision],
        capture_output=True,
        check=False,
    )
    if archive.returncode:
        print(f"error: git archive {revision}: {archive.stderr.decode().strip()}", file=sys.stderr)
        raise SystemExit(2)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    return folder


@contextlib.contextmanager
def imported_from(folder: Path) -> Iterator[None]:
    """Imports within the block resolve this project's modules from `folder`; the ones
    imported before it are put back after it (so that a caller's modules stay its own)."""

    def own() -> list[str]:
        return [name for name in sys.modules if name.split(".")[0] in _OWN_MODULES]

    before = {name: sys.modules.pop(name) for name in own()}
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))
        for name in own():
            del sys.modules[name]
        sys.modules.update(before)


def build_step(
    folder: Path, preset: str, vocab_size: int, rows: int, length: int, warmup: int
) -> Callable[[], None]:
    """A callable running one train step of the revision in `folder`, already compiled.

    The first call (tracing and compiling) and `warmup` more run while the
    revision's modules are the importable ones.
    """
    with imported_from(folder):
        train_speed = importlib.import_module("benchmarks.train_speed")
        config = importlib.import_module("transformer").TransformerConfig
        cfg = config.preset(preset, vocab_size=vocab_size)
        step, state, batch = train_speed.make_step_inputs(cfg, rows, length, length)

        def run() -> None:
            nonlocal state
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)

        for _ in range(1 + warmup):
            run()
    return run


def alternate(runs: list[Callable[[], None]], rounds: int) -> list[list[float]]:
    """Seconds per step of each run over `rounds` rounds, one step of each per round."""
    times: list[list[float]] = [[] for _ in runs]
    for round_ in range(rounds):
        order = range(len(runs)) if round_ % 2 == 0 else reversed(range(len(runs)))
        for i in order:
            start = time.perf_counter()
            runs[i]()
            times[i].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revisions", nargs=2, help=f"two git revisions, or {WORKTREE}")
    parser.add_argument("--preset", default="mini")
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="vocabulary size [the checkout's train.py default]",
    )
    parser.add_argument(
        "--rows",
        type=int,
        help="sentences per step [as many as train.py's default token budget holds at "
        "--length, rounded down to a multiple of the local devices: 64 at 16]",
    )
    parser.add_argument("--length", type=int, default=16, help="source and target tokens")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    args = parser.parse_args(argv)
    for name in ("rounds", "rows", "length"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup cannot be negative (the first step, compiling, is never timed)")

    with imported_from(REPO):
        importlib.import_module("transformer.host_memory").keep_freed_host_memory()
        if args.vocab_size is None:
            args.vocab_size = importlib.import_module("train").DATA_DEFAULTS["vocab_size"]
        train_speed = importlib.import_module("benchmarks.train_speed")
        train_speed.check_preset_names(parser, "--preset", [args.preset])
        train_speed.check_step_shape_arguments(parser, args)
        args.rows = train_speed.step_rows(parser, args.rows, args.length, args.length)

    with tempfile.TemporaryDirectory() as tmp:
        # Both exported first, so that a bad revision fails before anything is compiled.
        folders = [
            export_revision(revision, Path(tmp), position)
            for position, revision in enumerate(args.revisions)
        ]
        for revision, folder in zip(args.revisions, folders, strict=True):
            if not (folder / "benchmarks" / "train_speed.py").is_file():
                parser.error(
                    f"{revision} has no benchmarks/train_speed.py, which builds the step; "
                    "compare revisions of this repository from when it had one"
                )
        runs = []
        for revision, folder in zip(args.revisions, folders, strict=True):
            start = time.perf_counter()
            run = build_step(
                folder, args.preset, args.vocab_size, args.rows, args.length, args.warmup
            )
            seconds = time.perf_counter() - start
            print(f"{revision}: built, compiled and warmed up in {seconds:.1f} s")
            runs.append(run)
        times = alternate(runs, args.rounds)

    medians = [float(np.median(t)) for t in times]
    shape = f"{args.preset}, {args.rows} x ({args.length} + {args.length}) tokens"
    print(f"{shape}, {args.rounds} alternating rounds:")
    for revision, median, t in zip(args.revisions, medians, times, strict=True):
        print(f"  {revision}: median {median * 1e3:.1f} ms/step (min {min(t) * 1e3:.1f})")
    a, b = times
    b_faster = sum(tb < ta for ta, tb in zip(a, b, strict=True))
    print(
        f"  {args.revisions[1]} / {args.revisions[0]}: {medians[1] / medians[0]:.3f}; "
        f"{args.revisions[1]} faster in {b_faster} of {args.rounds} rounds"
    )


if __name__ == "__main__":
    main()
