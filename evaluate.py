"""Translate with a trained run and score it with sacreBLEU; or translate stdin; or draw attention.

Score a split of the run's corpus (data directory and language pair come
from workdir/config.json), or any pair of files::

    python evaluate.py --workdir runs/base --split test2016 --output test2016.hyp
    python evaluate.py --workdir runs/base --src-file my.en --ref-file my.de

BLEU and chrF are computed by sacreBLEU on detokenized, cased output against
the raw reference file, and printed with their sacreBLEU signatures. The
parameters are the average of the run's last 5 checkpoints unless
--checkpoint or --average-last says otherwise.

Translate standard input (or --input FILE), one line out for each line in::

    echo "A man rides a bike." | python evaluate.py --workdir runs/base --translate

At a terminal (stdin not redirected), --translate translates each line as it is
typed, until Ctrl-D.

Cross-attention heatmaps of the first N sentences (one PNG per decoder layer)::

    python evaluate.py --workdir runs/base --split val --plot-attention 3 --plot-dir plots

The training curve (loss and validation BLEU against time, from metrics.jsonl)::

    python evaluate.py --workdir runs/base --plot-curve curve.png
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def _interrupted_while_loading(signum, frame) -> None:
    """SIGINT while the libraries below load, before `main` handles it: nothing is written
    yet, so the command ends at once. A KeyboardInterrupt raised then printed a traceback,
    or was dropped by JAX's garbage-collection callback and the command went on."""
    os.write(2, b"interrupted\n")
    os._exit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted_while_loading)

import numpy as np
from sacrebleu.metrics import BLEU, CHRF

from data import (
    CorpusSpec,
    DataError,
    decode_lines,
    load_corpus,
    read_aligned_lines,
    read_lines,
    tfds_source,
)
from data.batching import inference_length
from data.errors import os_error_line, out_of_memory_line
from data.text import (
    discard_writes,
    is_a_terminal,
    is_written_in_place,
    write_text_atomically,
)
from transformer.checkpoints import (
    CONFIG_FILE,
    CheckpointError,
    is_run_file,
    load_run_config,
    silence_orbax_logs,
    training_there,
)
from transformer.compilation_cache import (
    EMPTY_CACHE_FLAG,
    exit_process,
    persistent_compilation_cache,
)
from transformer.translate import (
    DEFAULT_AVERAGE_LAST,
    Run,
    detokenize,
    encode_sources,
    load_run,
    translate_ids,
)

STDOUT = "-"  # --output's name for standard output
DEFAULT_BEAM, DEFAULT_ALPHA = 5, 1.25
DEFAULT_MAX_EXTRA_LEN, DEFAULT_MAX_TOKENS, DEFAULT_PLOT_DIR = 50, 4096, "attention_plots"
LARGEST_SEARCH_SIZE = 2**20  # --beam and --max-extra-len; far past any useful setting


def _to_stdout(output: str | None) -> bool:
    """Whether --output is standard output: "-", or a name of the file stdout writes to
    (/dev/stdout; the file a shell sent stdout to). That file is written through stdout,
    as "-" is, with the scores to stderr: replacing it would take it from the shell's
    redirect (the scores then lost), and opening it anew would cut off what came before."""
    if output is None or output == STDOUT:
        return output == STDOUT
    try:
        return os.path.samestat(os.stat(output), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError, AttributeError):  # no such file; no stdout file
        return False


def _output_file(args: argparse.Namespace) -> str | None:
    """The file --output names, if it names one other than standard output."""
    return None if _to_stdout(args.output) else args.output


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistyped or missing flag as one line instead of the whole usage."""

    def error(self, message: str):
        self.exit(2, f"error: {message}; {self.prog} --help lists the flags\n")


class UsageError(Exception):
    """A bad combination of flags; str() is a one-line message."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(
        prog="evaluate.py",
        description="Translate with a trained run; score with sacreBLEU; plot attention.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--workdir", required=True, help="run directory written by train.py")
    what = p.add_argument_group("what to translate (one of)")
    what.add_argument("--split", help="a split of the run's corpus, e.g. val or test2016")
    what.add_argument("--src-file", help="source sentences, one per line")
    what.add_argument("--ref-file", help="reference translations of --src-file, one per line")
    what.add_argument(
        "--translate", action="store_true", help="translate stdin (or --input) to stdout"
    )
    what.add_argument("--input", help="with --translate: read this file instead of stdin")
    what.add_argument(
        "--plot-curve",
        metavar="PNG",
        help="only draw the training curve (loss, validation BLEU against time) to this PNG file "
        "(.png is added to a name without a suffix)",
    )
    p.add_argument(
        "--output",
        help="write the translations here, one per input line ('-' or /dev/stdout: to stdout, "
        "the scores then to stderr)",
    )
    model = p.add_argument_group("parameters")
    model.add_argument(
        "--checkpoint",
        default=argparse.SUPPRESS,
        help="one checkpoint instead of the average: 'best' (validation BLEU), 'last' or a step",
    )
    model.add_argument(
        "--average-last",
        type=int,
        default=argparse.SUPPRESS,
        metavar="K",
        help=f"average the parameters of the last K checkpoints [{DEFAULT_AVERAGE_LAST}, or the "
        "recent ones the run keeps if fewer; scored best on Multi30k val, README]",
    )
    search = p.add_argument_group("search")
    search.add_argument(
        "--beam",
        type=int,
        default=argparse.SUPPRESS,
        help=f"beam size [{DEFAULT_BEAM}] (the paper: 4; {DEFAULT_BEAM} scored best on Multi30k "
        "val, README)",
    )
    search.add_argument(
        "--alpha",
        type=float,
        default=argparse.SUPPRESS,
        help=f"length penalty strength [{DEFAULT_ALPHA}] (the paper: 0.6; {DEFAULT_ALPHA} scored "
        "best on Multi30k val, README)",
    )
    search.add_argument("--greedy", action="store_true", help="greedy search instead of beam")
    search.add_argument(
        "--max-extra-len",
        type=int,
        default=DEFAULT_MAX_EXTRA_LEN,
        help="outputs have at most (source length + this) tokens",
    )
    search.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="most padded source tokens per decoding batch (a longer sentence is decoded alone)",
    )
    plots = p.add_argument_group("attention pictures")
    plots.add_argument(
        "--plot-attention", type=int, default=0, metavar="N", help="plot the first N sentences"
    )
    plots.add_argument("--plot-dir", default=DEFAULT_PLOT_DIR, help="where to write the PNGs")
    plots.add_argument("--plot-heads", action="store_true", help="also a per-head grid per layer")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (none where stderr is not a terminal: a log file)",
    )
    cache = p.add_mutually_exclusive_group()
    cache.add_argument(
        "--compilation-cache",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="where compiled programs are kept for later runs to load [$JAX_COMPILATION_CACHE_DIR, "
        "else $TRANSFORMER_MT_CACHE/xla or ~/.cache/transformer-mt/xla]",
    )
    cache.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="compile every program afresh and keep none",
    )
    args = p.parse_args(argv)
    if args.greedy and (hasattr(args, "beam") or hasattr(args, "alpha")):
        p.error("--greedy searches without a beam: drop --beam and --alpha, or --greedy")
    # Which were given, for the flags --plot-curve refuses: their defaults fill them in next.
    args.beam_flags = [f"--{name}" for name in ("beam", "alpha") if hasattr(args, name)]
    args.beam, args.alpha = (
        getattr(args, "beam", DEFAULT_BEAM),
        getattr(args, "alpha", DEFAULT_ALPHA),
    )
    # Not given = None (kept out of the help's "(default: ...)": the default is averaging,
    # and the cache's is worked out when it is used).
    for name in ("checkpoint", "average_last", "compilation_cache"):
        setattr(args, name, getattr(args, name, None))
    if args.compilation_cache == "":  # would be the current folder
        p.error(EMPTY_CACHE_FLAG)
    return args


def _is_step(text: str) -> bool:
    """A step number in ASCII digits (`str.isdigit` also takes "²", which `int` refuses)."""
    return text.isascii() and text.isdigit()


def _check_args(args: argparse.Namespace) -> None:
    modes = [bool(args.split), bool(args.src_file), args.translate, bool(args.plot_curve)]
    if sum(modes) != 1:
        raise UsageError("choose exactly one of --split, --src-file, --translate or --plot-curve")
    if args.plot_curve:
        # Flags that decode or draw attention, given (or set off their defaults).
        given = [
            flag
            for flag, value in (
                ("--output", args.output),
                ("--checkpoint", args.checkpoint),
                ("--average-last", args.average_last),
                ("--plot-attention", args.plot_attention),
                ("--greedy", args.greedy),
                ("--max-extra-len", args.max_extra_len != DEFAULT_MAX_EXTRA_LEN),
                ("--max-tokens", args.max_tokens != DEFAULT_MAX_TOKENS),
                ("--plot-dir", args.plot_dir != DEFAULT_PLOT_DIR),
                ("--plot-heads", args.plot_heads),
            )
            if value
        ] + getattr(args, "beam_flags", [])
        if given:
            raise UsageError(f"--plot-curve only draws the training curve: drop {given[0]}")
    if args.ref_file and not args.src_file:
        raise UsageError("--ref-file needs --src-file")
    if args.src_file and not (args.ref_file or args.output or args.plot_attention):
        raise UsageError(
            "--src-file alone would translate into nothing: add --output FILE (or --ref-file "
            "to score the translations; --translate --input FILE prints them)"
        )
    if args.translate and _to_stdout(args.output):
        raise UsageError(
            f"--translate prints the translations already: drop --output {args.output}"
        )
    if args.plot_dir != DEFAULT_PLOT_DIR and not args.plot_attention:
        raise UsageError(
            "--plot-dir is where --plot-attention N writes: add it, or drop --plot-dir"
        )
    if args.plot_heads and not args.plot_attention:
        raise UsageError("--plot-heads adds to --plot-attention N's plots: add it, or drop it")
    if args.input and not args.translate:
        raise UsageError("--input goes with --translate (use --src-file to score a file)")
    if args.translate and not args.input and sys.stdin is None:
        raise UsageError("standard input is closed: give the sentences on it, or --input FILE")
    if (args.translate or args.output == STDOUT) and sys.stdout is None:
        raise UsageError(
            "standard output is closed, and the translations go there: send it to a file"
        )
    for name in ("beam", "max_tokens"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("beam", "max_extra_len"):  # the search counts in 32-bit integers
        if getattr(args, name) > LARGEST_SEARCH_SIZE:
            raise UsageError(f"--{name.replace('_', '-')} must be at most {LARGEST_SEARCH_SIZE:,}")
    if not 0 <= args.alpha < float("inf"):  # NaN fails too
        raise UsageError(f"--alpha must be a finite number >= 0, got {args.alpha}")
    if args.max_extra_len < 0 or args.plot_attention < 0:
        raise UsageError("--max-extra-len and --plot-attention cannot be negative")
    if args.average_last is not None and args.average_last < 1:
        raise UsageError("--average-last must be at least 1")
    if args.checkpoint is not None and args.average_last is not None:
        raise UsageError("give --checkpoint (one checkpoint) or --average-last K, not both")
    if args.checkpoint not in (None, "best", "last") and not _is_step(args.checkpoint):
        raise UsageError(
            f"--checkpoint must be 'best', 'last' or a step number, not {args.checkpoint!r}"
        )


def load_sources_and_references(
    args: argparse.Namespace, workdir: str
) -> tuple[list[str], list[str] | None, str]:
    """The sentences to translate, the raw references (None if there are none), and a name;
    a --split is read from the corpus of `workdir`'s run."""
    if args.translate:
        if args.input:
            return read_lines(args.input), None, args.input
        return decode_lines(sys.stdin.buffer.read(), "standard input"), None, "stdin"
    if args.src_file:
        if not args.ref_file:
            sources = read_lines(args.src_file)
            if not sources:  # a wrong file, most likely: --translate is for filters
                raise DataError(f"{args.src_file} is empty: nothing to translate")
            return sources, None, args.src_file
        sources, references = read_aligned_lines(args.src_file, args.ref_file)
        if not sources:  # sacreBLEU fails on an empty corpus with an IndexError
            raise DataError(f"{args.src_file} and {args.ref_file} are empty: nothing to score")
        return sources, references, args.src_file
    spec = CorpusSpec.from_settings(load_run_config(workdir).get("data") or {})
    if spec.data_dir and not Path(spec.data_dir).is_dir():
        raise DataError(
            f"the run's data directory {spec.data_dir} (its {CONFIG_FILE}) is not there; "
            "put the files back there or score them with --src-file and --ref-file"
        )
    corpus = load_corpus(spec, args.split, clean=False)
    output = _output_file(args)
    for path, side in ((corpus.src_path, "source"), (corpus.tgt_path, "reference")):
        if output and path and Path(path).resolve() == Path(output).resolve():
            raise UsageError(
                f"--output {args.output} is split {args.split}'s {side} file; "
                "name another file, or it would be overwritten"
            )
    if not corpus.src:
        files = f" ({corpus.src_path} and {corpus.tgt_path})" if corpus.src_path else ""
        raise DataError(f"split {args.split} is empty{files}: nothing to score")
    # Score against the raw references (the file, or the raw TFDS sentences), not the
    # normalized text.
    references = corpus.references()
    return list(corpus.src), references, f"{args.split} {spec.src}-{spec.tgt}"


def score(hypotheses: list[str], references: list[str]) -> list[str]:
    """sacreBLEU BLEU and chrF of detokenized hypotheses against one reference each.

    Args:
      hypotheses: one translation per line.
      references: the raw reference lines, same count.

    Returns:
      Lines in sacreBLEU's own format, signature included, e.g.
      "BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0 = 35.21 ...".
    """
    lines = []
    for metric in (BLEU(), CHRF()):
        result = metric.corpus_score(hypotheses, [references])
        lines.append(result.format(width=2, signature=str(metric.get_signature())))
    return lines


def plot_attention(
    run: Run, src_ids: list[list[int]], hyp_ids: list[list[int]], args: argparse.Namespace
) -> list[str]:
    """Cross-attention PNGs of the first N non-empty sentences; returns the paths."""
    from transformer import visualize  # matplotlib only when asked for

    tok = run.tokenizer
    paths = []
    chosen = [i for i, ids in enumerate(src_ids) if ids][: args.plot_attention]
    for i in chosen:
        tgt_out = list(hyp_ids[i]) + [tok.eos_id]
        layers = visualize.cross_attention_weights(
            run.model,
            run.params,
            np.asarray([src_ids[i]]),
            np.asarray([tgt_out]),
            bos_id=tok.bos_id,
        )
        paths += visualize.plot_sentence_attention(
            [w[0] for w in layers],
            [tok.id_to_piece(t) for t in src_ids[i]],
            [tok.id_to_piece(t) for t in tgt_out],
            args.plot_dir,
            name=f"sentence_{i + 1:04d}",
            heads=args.plot_heads,
        )
    return paths


def plot_curve(workdir: str, path: str) -> int:
    """Draws the run's training curve from metrics.jsonl; returns the exit status."""
    from transformer import visualize
    from transformer.training import METRICS_FILE, read_metrics

    if Path(workdir).exists() and not Path(workdir).is_dir():
        raise UsageError(f"--workdir {workdir} is a file, not a directory")
    if not Path(workdir).is_dir():
        raise UsageError(f"--workdir {workdir} does not exist; train into it with train.py first")
    try:
        png = visualize.png_path(path)
    except ValueError as e:
        raise UsageError(f"--plot-curve {e}") from None
    _check_can_create("--plot-curve", path, png.parent)
    # A run setting up or before its first logged step has nothing to draw yet.
    wait = training_there(workdir, "draw the curve once it has logged its first steps")
    if not any((Path(workdir) / name).is_file() for name in (CONFIG_FILE, METRICS_FILE)):
        raise UsageError(
            f"{workdir} has no {CONFIG_FILE} or {METRICS_FILE}"
            + (wait or "; is it a workdir written by train.py?")
        )
    try:
        visualize.plot_training_curve(read_metrics(workdir), png)
    except ValueError as e:
        raise UsageError(f"{workdir}: {e}{wait}") from None
    print(f"wrote {png}", file=sys.stderr)
    return 0


def _check_can_create(flag: str, name: str, directory: Path) -> None:
    """Fails where files cannot be made in `directory`: a file stands on its path, or it
    (or, where it is still to be made, the nearest folder above it) cannot be written."""
    first = next(p for p in (directory, *directory.parents) if p.exists())
    if not first.is_dir():
        raise UsageError(f"{flag} {name}: {first} is not a directory")
    try:
        if first == directory:
            tempfile.TemporaryFile(dir=directory).close()
        elif not os.access(first, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as e:
        raise UsageError(f"{flag} {name}: cannot write there ({e.strerror})") from None


def _is_standard_input(path: Path) -> bool:
    """Whether `path` is the regular file that standard input was redirected from."""
    try:
        stdin = os.fstat(sys.stdin.fileno())
        return stat.S_ISREG(stdin.st_mode) and os.path.samestat(stdin, os.stat(path))
    except (OSError, ValueError, AttributeError):  # no such file; a stdin without a descriptor
        return False


def _check_output_places(args: argparse.Namespace) -> None:
    """Fails before decoding, not after, where --output or --plot-dir cannot be written."""
    plot_dir = args.plot_dir if args.plot_attention else None
    for flag, place in (
        ("--output", _output_file(args)),
        ("--plot-curve", args.plot_curve),
        ("--plot-dir", plot_dir),
    ):
        if place and is_run_file(args.workdir, place):
            raise UsageError(
                f"{flag} {place} is a file the run keeps in its workdir (overwritten, the run "
                "would be broken); name another file"
            )
    if _output_file(args):
        output = Path(args.output)
        if output.is_dir() or args.output.endswith(("/", os.sep)):
            raise UsageError(f"--output {args.output} is a directory; name a file")
        for flag in ("input", "src_file", "ref_file"):
            given = getattr(args, flag)
            if given and Path(given).resolve() == output.resolve():
                raise UsageError(
                    f"--output {args.output} is the --{flag.replace('_', '-')} file; "
                    "name another file, or it would be overwritten"
                )
        if args.translate and not args.input and _is_standard_input(output):
            raise UsageError(  # `--translate --output f < f`
                f"--output {args.output} is the file standard input reads; name another file, "
                "or it would be overwritten"
            )
        if is_written_in_place(output):
            if not os.access(output, os.W_OK):
                raise UsageError(f"--output {args.output}: not writable")
        else:  # where write_text_atomically writes: a link's file, so its folder
            _check_can_create("--output", args.output, Path(os.path.realpath(output)).parent)
    if args.plot_attention:
        _check_can_create("--plot-dir", args.plot_dir, Path(args.plot_dir))


def _warn_of_long_sources(src_ids: list[list[int]], max_len: int) -> None:
    """Warns where sources are longer than the model's max_len: they are decoded whole."""
    longer = [len(ids) for ids in src_ids if len(ids) > max_len]
    if longer:
        print(
            f"warning: source lines longer than the model's max_len of {max_len} tokens: "
            f"{len(longer)} (the longest {max(longer)} tokens); they are translated whole, "
            "in memory that grows with the square of their length",
            file=sys.stderr,
        )


def _memory_advice(args: argparse.Namespace, src_ids: Sequence[Sequence[int]]) -> str:
    """What to lower when decoding runs out of memory.

    A line padded to more than half of --max-tokens is decoded in a batch of its own
    (`decoding_batches`), which no lower --max-tokens shrinks: the advice then names the
    longest line.
    """
    advice = "lower --max-tokens, --beam or --max-extra-len"
    if not src_ids:
        return advice
    longest = max(range(len(src_ids)), key=lambda i: len(src_ids[i]))
    tokens = len(src_ids[longest])
    if 2 * inference_length(tokens) <= args.max_tokens:
        return advice
    return (
        f"{advice}; source line {longest + 1} ({tokens} tokens) is decoded alone whatever "
        "--max-tokens is: if it is the one, shorten or split it"
    )


def _load_run(args: argparse.Namespace) -> Run:
    """Loads --checkpoint, or the average of the last --average-last K checkpoints.

    Without either: `load_run`'s default, the average of the last
    DEFAULT_AVERAGE_LAST checkpoints, or of all the recent ones if the run has fewer.
    """
    if args.checkpoint is not None:
        which = int(args.checkpoint) if _is_step(args.checkpoint) else args.checkpoint
        return load_run(args.workdir, checkpoint=which)
    if args.average_last is not None:
        return load_run(args.workdir, average_last=args.average_last)
    return load_run(args.workdir)  # the library's default is this command's


def main(
    argv: list[str] | None = None, *, load: Callable[[argparse.Namespace], Run] = _load_run
) -> int:
    """The command line; `load` gives the parameters to decode with (benchmarks/soup.py's own)."""
    args = parse_args(argv)
    silence_orbax_logs()  # a damaged checkpoint is one warning line, not asyncio's dozens
    with (
        persistent_compilation_cache(args.compilation_cache, enabled=not args.no_compilation_cache),
        _recorded_interrupts() as interrupted,
    ):
        return _evaluate(args, load, interrupted)


class _Interrupts:
    """A SIGINT handler that raises KeyboardInterrupt, as Python's own does, and records it:
    Python drops what a garbage-collection callback raises (JAX runs one often), so a
    Ctrl-C can vanish; `check` raises it again, before anything is written."""

    def __init__(self):
        self.seen = False

    def __call__(self, signum, frame):
        self.seen = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt


@contextlib.contextmanager
def _recorded_interrupts():
    """`_Interrupts` as the SIGINT handler inside (in the main thread: only it sets one)."""
    interrupts = _Interrupts()
    if threading.current_thread() is not threading.main_thread():
        yield interrupts
        return
    previous = signal.signal(signal.SIGINT, interrupts)
    try:
        yield interrupts
    finally:
        signal.signal(signal.SIGINT, previous)


def _search_name(args: argparse.Namespace) -> str:
    return "greedy" if args.greedy else f"beam {args.beam}, alpha {args.alpha}"


def _search(
    run: Run, src_ids: list[list[int]], args: argparse.Namespace, *, progress: bool
) -> list[list[int]]:
    """The output ids of source ids (`encode_sources`), by the search the flags choose."""
    tok = run.tokenizer
    return translate_ids(
        run.model,
        run.params,
        src_ids,
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
        greedy=args.greedy,
        beam_size=args.beam,
        alpha=args.alpha,
        max_extra_len=args.max_extra_len,
        max_tokens=args.max_tokens,
        progress=progress,
    )


def _typed(args: argparse.Namespace) -> bool:
    """--translate of lines typed at a terminal, to stdout: each is translated as it comes
    (read to its end first, they came out only after Ctrl-D)."""
    return (
        args.translate
        and not (args.input or args.output or args.plot_attention)
        and sys.stdin.isatty()
    )


def translate_typed_lines(args: argparse.Namespace, run: Run, interrupted: _Interrupts) -> int:
    """Translates each line of standard input (a terminal) as it is entered, to stdout,
    until its end (Ctrl-D). A line that is no UTF-8 text gets its error and no output."""
    print(
        f"{args.workdir}: {run.checkpoint}; {_search_name(args)}; translating each line "
        "typed, until Ctrl-D",
        file=sys.stderr,
    )
    for number, raw in enumerate(sys.stdin.buffer, 1):
        try:
            sources = decode_lines(raw, "standard input", first_line=number)
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        src_ids = encode_sources(run.tokenizer, sources)
        _warn_of_long_sources(src_ids, run.model.config.max_len)
        hyp_ids = _search(run, src_ids, args, progress=False)
        interrupted.check()
        print(detokenize(run.tokenizer, hyp_ids)[0], flush=True)
    return 0


def _evaluate(
    args: argparse.Namespace, load: Callable[[argparse.Namespace], Run], interrupted: _Interrupts
) -> int:
    """main's work once flags are parsed; errors become `error: ...` lines and status 2."""
    src_ids: list[list[int]] = []
    written = False
    try:
        _check_args(args)
        _check_output_places(args)
        if args.plot_curve:
            return plot_curve(args.workdir, args.plot_curve)
        if _typed(args):
            return translate_typed_lines(args, load(args), interrupted)
        if args.no_progress:  # nor TFDS's bars, where a --split of a tfds run is prepared
            tfds_source.show_progress_bars(False)
        # The inputs first: a wrong file is found before the checkpoints are read.
        sources, references, name = load_sources_and_references(args, args.workdir)
        run = load(args)
        # Where the translations go to stdout, the scores go to stderr, out of their way.
        to_stdout = args.translate or _to_stdout(args.output)
        log = print if not to_stdout else lambda *a: print(*a, file=sys.stderr)
        print(
            f"{args.workdir}: {run.checkpoint}; {name}: {len(sources)} sentences; "
            f"{_search_name(args)}",
            file=sys.stderr,
        )
        start = time.perf_counter()
        src_ids = encode_sources(run.tokenizer, sources)
        _warn_of_long_sources(src_ids, run.model.config.max_len)
        bar = not args.no_progress and is_a_terminal(sys.stderr)  # none into `2> eval.log`
        hyp_ids = _search(run, src_ids, args, progress=bar)
        hypotheses = detokenize(run.tokenizer, hyp_ids)
        interrupted.check()  # a Ctrl-C that JAX's garbage-collection callback swallowed
        print(f"decoded in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        if _output_file(args):
            write_text_atomically(args.output, "".join(h + "\n" for h in hypotheses))
            written = True
        if to_stdout:
            sys.stdout.write("".join(h + "\n" for h in hypotheses))
        if references is not None:
            for line in score(hypotheses, references):
                log(line)
        if args.plot_attention:
            paths = plot_attention(run, src_ids, hyp_ids, args)
            print(f"wrote {len(paths)} attention plots to {args.plot_dir}", file=sys.stderr)
    except (UsageError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `evaluate.py --translate ... | head`: the reader has ended
        # What stdout still holds would fail again at exit: it goes to /dev/null instead.
        with contextlib.suppress(OSError, ValueError):  # a stdout without a descriptor
            discard_writes([sys.stdout.fileno()])
        print(
            "error: the output's reader ended before it was all written (a broken pipe)",
            file=sys.stderr,
        )
        return 128 + signal.SIGPIPE  # as the shell reports a command that SIGPIPE ended
    except OSError as e:
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        line = out_of_memory_line(e, _memory_advice(args, src_ids))
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        output = None if written else _output_file(args)
        print(
            f"interrupted; --output {output} was not written" if output else "interrupted",
            file=sys.stderr,
        )
        return 130
    return 0


if __name__ == "__main__":
    exit_process(main)
