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
    average_params,
    checkpoint_steps,
    restore_params,
)
from transformer.translate import detokenize, encode_sources, load_run, translate_ids  # noqa: E402


def soup_params(workdirs: list[Path], last: int):
    """The average of the last `last` checkpoints of every workdir (all weighted alike)."""
    params = []
    for workdir in workdirs:
        for step in checkpoint_steps(workdir)[-last:]:
            params.append(restore_params(workdir, step)[0])
    return average_params(params)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workdirs", nargs="+", type=Path)
    p.add_argument("--average-last", type=int, default=evaluate.DEFAULT_AVERAGE_LAST)
    args, rest = p.parse_known_args(argv)
    ev_args = evaluate.parse_args(["--workdir", str(args.workdirs[0]), *rest])
    run = load_run(args.workdirs[0], average_last=1)
    params = soup_params(args.workdirs, args.average_last)
    sources, references, name = evaluate.load_sources_and_references(ev_args, run)
    tok = run.tokenizer
    ids = translate_ids(
        run.model,
        params,
        encode_sources(tok, sources),
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
        greedy=ev_args.greedy,
        beam_size=ev_args.beam,
        alpha=ev_args.alpha,
        max_extra_len=ev_args.max_extra_len,
        max_tokens=ev_args.max_tokens,
        progress=False,
    )
    dirs = " + ".join(str(w) for w in args.workdirs)
    search = "greedy" if ev_args.greedy else f"beam {ev_args.beam}, alpha {ev_args.alpha}"
    print(f"{dirs}: the last {args.average_last} of each; {name}; {search}")
    for line in evaluate.score(detokenize(tok, ids), references):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
