"""Decoding speed: beam search and greedy search, with and without the decoding cache.

    python benchmarks/decode_speed.py --workdir runs/base            # a trained run
    python benchmarks/decode_speed.py --limit 200                    # random "small" model

Translates a split (default Multi30k test2016) with each of: beam search
(beam 4, alpha 0.6) and greedy search, each with the cache (one new position
per step, cross-attention keys/values computed once per sentence) and without
it (the decoder recomputed over the whole prefix at every step). Prints
sentences/s and generated tokens/s (every output token, end token included,
of the returned hypotheses) and the cached/uncached speed ratio.

Each batch shape is compiled ahead of time and compilation is reported
separately, so the timings are steady-state decoding. Without --workdir a
randomly initialized model of the "small" preset is used, with a tokenizer
trained on the training split; such a model seldom emits the end token, so
most sentences decode to their length limit (source length + 50), which the
output reports.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import data  # noqa: E402
from transformer import Transformer, TransformerConfig  # noqa: E402
from transformer.checkpoints import CheckpointError, silence_orbax_logs  # noqa: E402
from transformer.decoding import beam_search, greedy_search  # noqa: E402
from transformer.translate import (  # noqa: E402
    decoding_batches,
    encode_sources,
    load_run,
    pad_batch_rows,
)

MODES = ("beam", "greedy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; --modes becomes a list of known modes (an unknown one is a usage error)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", help="a trained run; default: a random 'small' model")
    p.add_argument("--split", default="test2016")
    p.add_argument(
        "--data-dir",
        default=str(REPO.parent / "shared" / "data" / "multi30k"),
        help="Multi30k folder (without --workdir)",
    )
    p.add_argument("--limit", type=int, default=0, help="only the first N sentences [0: all]")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--max-extra-len", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--modes", default="beam,greedy", help="comma-separated: beam, greedy")
    p.add_argument("--no-uncached", action="store_true", help="skip the uncached baseline")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",")]
    for name in ("beam", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.alpha < float("inf"):  # NaN fails too
        p.error(f"--alpha must be a finite number >= 0, got {args.alpha}")
    if args.limit < 0 or args.max_extra_len < 0:
        p.error("--limit and --max-extra-len cannot be negative")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}")
    return args


def random_small_model(data_dir: str, vocab_size: int = 8000):
    """A random "small" model and a tokenizer trained on Multi30k en-de train."""
    corpus = data.load_corpus(data.CorpusSpec(dataset="files", data_dir=data_dir), "train")
    path = Path(tempfile.mkdtemp()) / "tokenizer.model"
    tokenizer = data.train_tokenizer(corpus.src + corpus.tgt, path, vocab_size=vocab_size)
    model = Transformer(TransformerConfig.preset("small", vocab_size=tokenizer.vocab_size))
    dummy = jnp.ones((1, 8), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), dummy, dummy)["params"]
    return model, params, tokenizer


def benchmark(model, params, tokenizer, batches, *, beam: int | None, use_cache: bool, args):
    """Compiles every batch shape, then times one pass; returns (compile_s, decode_s, outputs)."""
    kw = dict(
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        max_extra_len=args.max_extra_len,
        use_cache=use_cache,
    )
    if beam is None:
        search = greedy_search
    else:
        search, kw = beam_search, dict(kw, beam_size=beam, alpha=args.alpha)
    start = time.perf_counter()
    compiled = {}
    for src in batches:
        if src.shape not in compiled:
            compiled[src.shape] = search.lower(model, params, src, **kw).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    outputs = []
    for src in batches:
        result = compiled[src.shape](params, src)
        tokens = result if beam is None else result[0]
        outputs.append(np.asarray(jax.block_until_ready(tokens)))
    return compile_s, time.perf_counter() - start, outputs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return time_modes(args)
    except (data.DataError, CheckpointError) as e:  # a missing --split, file or workdir
        print(f"error: {e}", file=sys.stderr)
        return 2


def _sources(spec: data.CorpusSpec, args: argparse.Namespace) -> list[str]:
    """The --split's source sentences (the first --limit), of which one at least is not
    empty: with none, every rate would divide by zero."""
    sources = data.load_corpus(spec, args.split, clean=False).src
    if args.limit:
        sources = sources[: args.limit]
    if not any(map(data.normalize, sources)):  # what encode_sources leaves empty
        first = f"the first {args.limit} lines of " if args.limit else ""
        raise data.DataError(
            f"{first}--split {args.split} {'hold' if first else 'holds'} no source sentence "
            "to decode; choose another split"
        )
    return sources


def time_modes(args: argparse.Namespace) -> int:
    """Times every mode of `args` and prints the table; returns the exit status."""
    if args.workdir:
        silence_orbax_logs()  # a damaged checkpoint is one warning line, as in evaluate.py
        run = load_run(args.workdir, checkpoint="best")  # as its recorded figures were timed
        model, params, tokenizer = run.model, run.params, run.tokenizer
        spec = data.CorpusSpec.from_settings(run.config["data"])
        print(f"model: {args.workdir} ({run.checkpoint})")
        sources = _sources(spec, args)
    else:
        spec = data.CorpusSpec(dataset="files", data_dir=args.data_dir)
        # Read before the tokenizer is trained, so that a bad --split fails at once.
        sources = _sources(spec, args)
        model, params, tokenizer = random_small_model(args.data_dir)
        print(
            "model: RANDOMLY INITIALIZED 'small' preset (no --workdir), tokenizer trained on train"
        )
    params = jax.device_put(params)
    src_ids = [ids for ids in encode_sources(tokenizer, sources) if ids]
    batches = []
    for _, src in decoding_batches(src_ids, max_tokens=args.max_tokens, pad_id=tokenizer.pad_id):
        batches.append((len(src), pad_batch_rows(src)))
    c = model.config
    print(
        f"data: {args.split}, {len(src_ids)} sentences{' (--limit)' if args.limit else ''}, "
        f"{len(batches)} batches of <= {args.max_tokens} source tokens; model d_model={c.d_model} "
        f"layers={c.num_encoder_layers}+{c.num_decoder_layers} vocab={c.vocab_size}; "
        f"device: {jax.devices()[0].device_kind}"
    )
    header = f"{'search':<16}{'cache':<8}{'compile s':>10}{'decode s':>10}{'sent/s':>10}"
    print(header + f"{'tokens/s':>11}{'hit limit':>11}")
    for mode in args.modes:
        beam = args.beam if mode == "beam" else None
        name = f"beam {args.beam}" if beam else "greedy"
        speeds, results = {}, {}
        for use_cache in (True, False) if not args.no_uncached else (True,):
            compile_s, decode_s, outputs = benchmark(
                model,
                params,
                tokenizer,
                [b for _, b in batches],
                beam=beam,
                use_cache=use_cache,
                args=args,
            )
            real = [out[:n] for (n, _), out in zip(batches, outputs, strict=True)]
            tokens = sum(int(np.count_nonzero(o != tokenizer.pad_id)) for o in real)
            ended = sum(int(np.any(o == tokenizer.eos_id, axis=1).sum()) for o in real)
            speeds[use_cache] = len(src_ids) / decode_s
            results[use_cache] = real
            print(
                f"{name:<16}{'yes' if use_cache else 'no':<8}{compile_s:>10.1f}{decode_s:>10.1f}"
                f"{len(src_ids) / decode_s:>10.1f}{tokens / decode_s:>11.0f}"
                f"{len(src_ids) - ended:>7}/{len(src_ids)}",
                flush=True,
            )
        if False in speeds:
            same = all(
                np.array_equal(a, b) for a, b in zip(results[True], results[False], strict=True)
            )
            print(
                f"{name}: cached is {speeds[True] / speeds[False]:.1f}x faster than uncached; "
                f"identical outputs: {'yes' if same else 'NO'}"
            )
    print("'hit limit': sentences that reached source length + max_extra_len without an end token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
