"""Forks a training run at a checkpoint, to try other end-of-run settings paired on one run.

  python benchmarks/fork_run.py runs/base runs/fork --step 9000
  python train.py --workdir runs/fork --cooldown-shape sqrt     # resumes at 9000

The fork is a copy of the workdir without the checkpoints after `--step` and
without the metrics.jsonl lines after it (the TensorBoard events keep theirs
until train.py resumes the fork, which drops them). Resume is exact,
so resuming the fork with the same flags repeats the base run to the last
digit, and resuming it with settings that only differ after `--step` (a
cooldown that starts later, its shape) gives exactly the run those settings
would make from scratch, for the cost of the steps after `--step`. Two such
forks differ only by what was changed, not by a seed: the comparison is paired.

`--dropout-key N` gives the fork another dropout key (that of `--seed N`), and
so other dropout masks after `--step`, with everything else the same: how far
a score moves with that alone is the noise floor of a paired comparison. An N
whose key the checkpoint already has (the base run's --seed) is allowed, with a
warning: that fork repeats the base run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.errors import os_error_line  # noqa: E402
from transformer.checkpoints import (  # noqa: E402
    CONFIG_FILE,
    METRICS_FILE,
    CheckpointError,
    checkpoint_dir,
    checkpoint_steps,
    read_meta,
    update_meta,
)
from transformer.training import seed_keys, truncate_metrics  # noqa: E402


def fork(
    source: Path, destination: Path, step: int, dropout_key: int | None = None, log=print
) -> list[int]:
    """Copies `source` into `destination` with the checkpoints and metrics up to `step` only.

    Args:
      source: a train.py workdir holding a checkpoint at `step`.
      destination: a new directory (must not exist).
      step: the checkpoint the fork resumes from.
      dropout_key: if given, the fork's dropout key becomes that of `--seed dropout_key`.
      log: where the warning goes when that key is the one the checkpoint already has.

    Returns:
      The checkpoint steps of the fork.

    Raises:
      ValueError: no workdir at `source`, no checkpoint at `step`, `destination` exists,
        or a `dropout_key` outside [0, 2**32).
      CheckpointError: with a `dropout_key`, the checkpoint's meta item is no JSON object.
    """
    if dropout_key is not None and not 0 <= dropout_key < 2**32:  # as train.py's --seed
        raise ValueError(f"--dropout-key must be in [0, 2**32), got {dropout_key}")
    source = Path(source).resolve()  # as checkpoint_dir is, so the copy can tell it
    if not source.is_dir():
        raise ValueError(f"workdir {source} does not exist")
    if not (source / CONFIG_FILE).is_file():
        raise ValueError(f"{source} has no {CONFIG_FILE}: it is not a workdir written by train.py")
    checkpoints = checkpoint_dir(source)
    steps = checkpoint_steps(source)
    if step not in steps:
        raise ValueError(f"{checkpoints} has no checkpoint {step} (it has {steps})")
    if destination.exists():
        raise ValueError(f"{destination} exists; give a new directory")
    later = {str(s) for s in steps if s > step}
    try:
        shutil.copytree(
            source, destination, ignore=lambda d, names: later if Path(d) == checkpoints else []
        )
        if (destination / METRICS_FILE).exists():
            truncate_metrics(destination / METRICS_FILE, step)
        if dropout_key is not None:
            key = [int(x) for x in jax.device_get(seed_keys(dropout_key)[1]).ravel()]
            if read_meta(source, step).get("rng") == key:  # the source's: errors name it
                log(
                    f"warning: --dropout-key {dropout_key} is the key checkpoint {step} "
                    "already has: the fork repeats the base run"
                )
            update_meta(destination, step, {"rng": key})
    except BaseException:  # no half-made fork is left to be mistaken for one
        shutil.rmtree(destination, ignore_errors=True)
        raise
    return [s for s in steps if s <= step]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("source", type=Path, help="the workdir to fork")
    p.add_argument("destination", type=Path, help="the new workdir")
    p.add_argument("--step", type=int, required=True, help="the checkpoint to resume from")
    p.add_argument("--dropout-key", type=int, help="another dropout key: that of --seed N")
    args = p.parse_args(argv)
    try:
        warn = lambda line: print(line, file=sys.stderr)  # noqa: E731
        kept = fork(args.source, args.destination, args.step, args.dropout_key, log=warn)
    except (ValueError, CheckpointError, shutil.Error) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 2
    print(f"{args.destination}: checkpoints {kept[0]}..{kept[-1]}; resume it with train.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
