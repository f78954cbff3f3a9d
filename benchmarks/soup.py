"""BLEU of a "soup": the uniform average of the last K checkpoints of several workdirs.

  python benchmarks/soup.py runs/base runs/branch --split val     # evaluate.py's search

Meant for branches of one run (`benchmarks/fork_run.py`): they share every step
up to the fork, so their parameters can be averaged like the checkpoints of one
run. The first workdir gives the model, the tokenizer and the data; decoding and
scoring are evaluate.py's, and so are the flags other than --average-last
(--split, --beam, --alpha, ...), with its defaults.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import evaluate  # noqa: E402
from transformer.checkpoints import (  # noqa: E402
    CheckpointError,
    average_params,
    restore_last,
    tree_shapes,
)
from transformer.compilation_cache import exit_process  # noqa: E402
from transformer.translate import Run, load_model  # noqa: E402


def soup_params(workdirs: list[Path], last: int):
    """The average of the last `last` checkpoints of every workdir (all weighted alike).

    Raises:
      CheckpointError: a workdir has fewer than `last` checkpoints, or its
        parameters are not the shapes of the first workdir's (not a branch of
        the same run).
    """
    params = []
    for workdir in workdirs:
        trees, _ = restore_last(workdir, last, log=lambda _: None)
        if params and tree_shapes(trees[0]) != tree_shapes(params[0]):
            raise CheckpointError(
                f"{workdir}: its parameters are not shaped like {workdirs[0]}'s; "
                "a soup needs branches of one run (benchmarks/fork_run.py)"
            )
        params += trees
    return average_params(params)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="soup.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other flag is evaluate.py's (see python evaluate.py --help).",
    )
    p.add_argument("workdirs", nargs="+", type=Path, help="train.py workdirs: branches of one run")
    p.add_argument(
        "--average-last",
        type=int,
        default=evaluate.DEFAULT_AVERAGE_LAST,
        help=f"checkpoints taken from the end of each workdir [{evaluate.DEFAULT_AVERAGE_LAST}]",
    )
    args, rest = p.parse_known_args(argv)
    given = sys.argv[1:] if argv is None else list(argv)
    # argparse cannot tell evaluate.py's flags that take a value: in `--split val runs/a`
    # it would take "val" for a workdir, and evaluate.py would then miss --split's value.
    first_flag = next((i for i, a in enumerate(given) if a in rest and a.startswith("-")), None)
    if first_flag is not None and set(given[first_flag:]) & {str(w) for w in args.workdirs}:
        print(
            "error: give the workdirs first, then evaluate.py's flags: "
            f"soup.py runs/a runs/b --split val (got {given[first_flag]} before a workdir)",
            file=sys.stderr,
        )
        return 2
    dirs = " + ".join(str(w) for w in args.workdirs)

    def load(ev_args):  # the first workdir's model and tokenizer, with the soup's parameters
        k = ev_args.average_last
        model, tokenizer, config = load_model(args.workdirs[0])
        soup = soup_params(args.workdirs, k)
        return Run(model, soup, tokenizer, config, f"the last {k} checkpoints of each of {dirs}")

    first = ["--workdir", str(args.workdirs[0]), "--average-last", str(args.average_last)]
    return evaluate.main([*first, *rest], load=load)


if __name__ == "__main__":
    exit_process(main)
