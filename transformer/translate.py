"""Sentences in, translations out: normalize, tokenize, batch, search, detokenize.

The text side comes from the `data` package (normalization, the run's
SentencePiece tokenizer, length-sorted inference batches); the search is
`transformer.decoding`. Every special id is read from the tokenizer.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from tqdm import tqdm

from data import DataError, Tokenizer, normalize
from data.batching import inference_batches, inference_length
from transformer import checkpoints
from transformer.compilation_cache import compile_side_by_side
from transformer.config import TransformerConfig
from transformer.decoding import beam_search, greedy_search
from transformer.model import Transformer


def pad_batch_rows(src_bS: np.ndarray) -> np.ndarray:
    """Pads a batch [b, S] to a power-of-two row count by repeating its first sentence.

    Few batch shapes means few compiled search programs, and the copies finish
    together with the sentence they repeat, so they add no decoding steps.

    Args:
      src_bS: int source ids [b, S], b >= 1.

    Returns:
      [B, S] with B the smallest power of two >= b; rows b.. copy row 0.
    """
    rows = 1 << max(0, len(src_bS) - 1).bit_length()
    return np.concatenate([src_bS, np.repeat(src_bS[:1], rows - len(src_bS), 0)])


def decoding_batches(
    token_lists: Sequence[np.ndarray], *, max_tokens: int, pad_id: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`data.inference_batches` sized so that `pad_batch_rows` keeps them within `max_tokens`.

    Sentences of padded length S go in batches of at most the largest power of
    two <= max_tokens // S rows, so padding the rows up to a power of two never
    passes the budget (341 rows of 12 under 4096 would otherwise decode as 512
    rows, 6144 positions); row counts stay powers of two up to that cap, so the
    compiled search programs are no more than before.

    Args:
      token_lists: per sentence, its source ids (`x + [eos]`), none empty.
      max_tokens: most padded source positions per batch after `pad_batch_rows`;
        a sentence longer than that still gets a batch of its own.
      pad_id: padding id.

    Yields:
      `(indices [b], src [b, S])` as `inference_batches` does (longest first),
      with `pad_batch_rows(src)` at most max(max_tokens, S) positions.
    """
    lengths_N = np.array([inference_length(len(t)) for t in token_lists], np.int64)
    for S in sorted(set(lengths_N.tolist()), reverse=True):
        members = np.flatnonzero(lengths_N == S)
        rows = 1 << (max(1, max_tokens // S).bit_length() - 1)
        group = [token_lists[i] for i in members]
        for indices, src_bS in inference_batches(group, max_tokens=rows * S, pad_id=pad_id):
            yield members[indices], src_bS


# evaluate.py's default parameters: the average of the last 5 checkpoints (README: best on
# Multi30k val).
DEFAULT_AVERAGE_LAST = 5

# Compiled search programs, by what they were compiled for, least recently used first:
# see `search_programs`. A default evaluation uses 9 shapes, a training run's
# validation a few more; a longer-lived process (a sweep over beam sizes) drops the oldest.
_PROGRAMS: dict[tuple, jax.stages.Compiled] = {}
MAX_KEPT_PROGRAMS = 64


def search_programs(
    model: nn.Module,
    params: Any,
    shapes: Sequence[tuple[int, int]],
    *,
    greedy: bool,
    **options: Any,
) -> dict[tuple[int, int], Callable[[Any, np.ndarray], Any]]:
    """The compiled search program for each source batch shape, all compiled side by side.

    `jax.jit` would compile each shape's program when its first batch comes, one after
    another; lowering each in turn while threads compile the ones before
    (`compile_side_by_side`) has them ready sooner where there are cores to spare: in a
    trial on a lent H100 the 9 beam-search programs of test2016 took 4.5 to 7.8 s each
    side by side, all done 19 s after `evaluate.py` started, where one by one they had
    taken 3.3 to 4.1 s each (about 33 s in all). On a 2-core CPU it made no measurable
    difference (benchmarks/EXPERIMENTS.md), and the translations are the same. The last
    `MAX_KEPT_PROGRAMS` programs are kept for later calls with the same model, options,
    shape and parameters (shapes, dtypes, devices), as `jax.jit` keeps its own
    (training's validations decode the same shapes each time).

    Args:
      model: the encoder-decoder module.
      params: its parameters, on the device that decodes (`jax.device_put`).
      shapes: source batch shapes [B, S]; repeats are compiled once.
      greedy: `greedy_search` instead of `beam_search`.
      **options: the search's keyword arguments (ids, max_extra_len; beam_size, alpha).

    Returns:
      shape -> a function of (params, src [B, S]) that runs the search.
    """
    search = greedy_search if greedy else beam_search
    leaves, treedef = jax.tree.flatten(params)
    signature = (
        treedef,
        tuple((leaf.shape, leaf.dtype, getattr(leaf, "sharding", None)) for leaf in leaves),
        jax.config.jax_enable_x64,
        jax.config.jax_default_matmul_precision,
    )

    def key(shape: tuple[int, int]) -> tuple:
        return (search, model, tuple(sorted(options.items())), tuple(shape), signature)

    wanted = list(dict.fromkeys(map(tuple, shapes)))
    missing = [shape for shape in wanted if key(shape) not in _PROGRAMS]
    lowerings = [
        functools.partial(
            search.lower, model, params, jax.ShapeDtypeStruct(shape, jnp.int32), **options
        )
        for shape in missing
    ]
    programs = {shape: _PROGRAMS.pop(key(shape)) for shape in wanted if shape not in missing}
    programs.update(zip(missing, compile_side_by_side(lowerings), strict=True))
    for shape in wanted:  # most recently used last
        _PROGRAMS[key(shape)] = programs[shape]
    while len(_PROGRAMS) > MAX_KEPT_PROGRAMS:
        del _PROGRAMS[next(iter(_PROGRAMS))]
    return programs


def _integer_ids(ids: Sequence[int], index: int) -> np.ndarray:
    """One sentence's ids as int64 (none for an empty one); floats or strings would be
    truncated or parsed silently, and one id is a sentence's ids given without their list."""
    try:
        array = np.asarray(ids)
    except ValueError:  # sequences of different lengths inside
        array = np.asarray(ids, dtype=object)
    if array.ndim == 1 and array.size == 0:
        return np.zeros(0, np.int64)
    if array.ndim == 0 and array.dtype.kind in "iu":
        raise ValueError(
            f"src_ids[{index}] is the id {array}, not a sentence: give a list of sentences' ids "
            "([ids] for one sentence)"
        )
    if array.dtype.kind not in "iu" or array.ndim != 1:
        raise ValueError(
            f"src_ids[{index}] must be a flat sequence of integer token ids, got {array.dtype} "
            f"of shape {array.shape}: encode the sentence with the tokenizer"
        )
    return array.astype(np.int64)


def _without_end_padding(ids: np.ndarray, pad_id: int) -> np.ndarray:
    """A sentence's ids without the `pad_id`s it ends with (a row of a padded array)."""
    real = np.flatnonzero(ids != pad_id)
    return ids[: real[-1] + 1] if len(real) else ids[:0]


def _check_ids(sources: list[np.ndarray], indices: list[int], vocab_size: int | None) -> None:
    """Raises ValueError naming the first sentence with an id outside [0, vocab_size)."""
    if vocab_size is None or not sources:
        return
    every = np.concatenate(sources)
    if every.min() >= 0 and every.max() < vocab_size:
        return
    for i, ids in zip(indices, sources, strict=True):
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            raise ValueError(
                f"src_ids[{i}] holds id {bad[0]}, outside the model's vocabulary [0, "
                f"{vocab_size}): encode the sources with the tokenizer the model was trained with"
            )


def translate_ids(
    model: nn.Module,
    params: Any,
    src_ids: Sequence[Sequence[int]],
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int = 0,
    greedy: bool = False,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_extra_len: int = 50,
    max_tokens: int = 4096,
    progress: bool = False,
) -> list[list[int]]:
    """Decodes many token sequences in length-sorted batches, returned in input order.

    Args:
      model: the encoder-decoder module.
      params: its parameters.
      src_ids: per sentence, its source ids `x + [eos]`, each in [0, vocab_size)
        (any iterable of sequences; the rows of a padded array do too: ids equal to
        `pad_id` at the end of a sentence are dropped); an empty sequence (an empty
        input line, or a row of padding only) is not decoded and gives an empty
        output.
      bos_id: start token.
      eos_id: end token.
      pad_id: padding token.
      greedy: greedy search instead of beam search.
      beam_size: beam width (ignored when `greedy`).
      alpha: length penalty strength (ignored when `greedy`).
      max_extra_len: each output has at most len(source) + max_extra_len tokens.
      max_tokens: most padded source positions per decoded batch (rows padded to a
        power of two included); a longer sentence is decoded alone.
      progress: show a tqdm progress bar over sentences.

    Returns:
      Per sentence, the output ids without the end token.

    Raises:
      ValueError: a source id outside the model's vocabulary, which would embed as NaN
        (or wrap around, if negative) and decode to garbage, or one that is not an
        integer; a sentence that is one id (its ids given without a list around them);
        max_tokens below 1.
      TypeError: text in place of ids.
    """
    src_ids = src_ids if isinstance(src_ids, str) else list(src_ids)  # once, if a generator
    if isinstance(src_ids, str) or any(isinstance(ids, str) for ids in src_ids):
        raise TypeError(
            "src_ids holds text: give token ids per sentence (tokenizer.encode), or give the "
            "text to translate()"
        )
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    params = jax.device_put(params)  # once, not on every batch's call
    outputs: list[list[int]] = [[] for _ in src_ids]
    given = [_without_end_padding(_integer_ids(ids, i), pad_id) for i, ids in enumerate(src_ids)]
    todo = [i for i, ids in enumerate(given) if len(ids)]
    sources = [given[i] for i in todo]
    _check_ids(sources, todo, getattr(getattr(model, "config", None), "vocab_size", None))
    options = dict(bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, max_extra_len=max_extra_len)
    if not greedy:
        options.update(beam_size=beam_size, alpha=alpha)
    batches = [
        (indices, pad_batch_rows(src_bS))
        for indices, src_bS in decoding_batches(
            [ids.astype(np.int32) for ids in sources], max_tokens=max_tokens, pad_id=pad_id
        )
    ]
    programs = search_programs(
        model, params, [src_BS.shape for _, src_BS in batches], greedy=greedy, **options
    )
    with tqdm(total=len(todo), desc="decoding", unit="sent", disable=not progress) as bar:
        for indices, src_BS in batches:
            tokens_BL = programs[src_BS.shape](params, src_BS)
            if not greedy:
                tokens_BL, _ = tokens_BL  # beam search also gives the scores
            for i, row in zip(indices, np.asarray(tokens_BL), strict=False):
                ends = np.flatnonzero(row == eos_id)
                row = row[: ends[0]] if len(ends) else row
                outputs[todo[i]] = row[row != pad_id].tolist()
            bar.update(len(indices))
    return outputs


def translate(
    model: nn.Module,
    params: Any,
    tokenizer: Any,
    sentences: Sequence[str],
    *,
    greedy: bool = False,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_extra_len: int = 50,
    max_tokens: int = 4096,
    progress: bool = False,
) -> list[str]:
    """Translates raw sentences with beam search (or greedy search).

    Each sentence is normalized here with `data.normalize`, exactly as the
    training data was, so callers pass raw text (normalizing twice is
    harmless: `normalize` is idempotent). A sentence that is empty after
    normalization gives an empty translation.

    Args:
      model: the encoder-decoder module.
      params: its parameters.
      tokenizer: a `data.Tokenizer` (the run's SentencePiece model); supplies
        `encode`, `decode` and the pad, bos and eos ids.
      sentences: source sentences, one per entry.
      greedy: greedy search instead of beam search.
      beam_size: beam width (the paper: 4).
      alpha: length penalty strength (the paper: 0.6).
      max_extra_len: each output has at most len(source) + max_extra_len tokens.
      max_tokens: most padded source positions per decoded batch (rows padded to a
        power of two included); a longer sentence is decoded alone.
      progress: show a tqdm progress bar.

    Returns:
      The detokenized translations, one per input sentence, in input order.

    Raises:
      TypeError: a path in place of the tokenizer.
      ValueError: a tokenizer of another vocabulary size than the model's.
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(
            f"tokenizer must be a loaded tokenizer, got the path {str(tokenizer)!r}: "
            "use data.Tokenizer.load(path)"
        )
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab_size is not None and tokenizer.vocab_size != vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} pieces but the model's vocabulary is "
            f"{vocab_size}: use the tokenizer the model was trained with"
        )
    src_ids = encode_sources(tokenizer, sentences)
    hypotheses = translate_ids(
        model,
        params,
        src_ids,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        greedy=greedy,
        beam_size=beam_size,
        alpha=alpha,
        max_extra_len=max_extra_len,
        max_tokens=max_tokens,
        progress=progress,
    )
    return detokenize(tokenizer, hypotheses)


def detokenize(tokenizer: Any, hypotheses: Sequence[Sequence[int]]) -> list[str]:
    """Text of output ids, one line each: a line break the model spelled out becomes a space.

    A line break is anything `str.splitlines` splits at: besides ``\\n`` and ``\\r``,
    byte-fallback pieces can spell ``\\x0b``, ``\\x0c``, ``\\x1c``-``\\x1e``,
    ``\\x85``, U+2028 and U+2029, which `splitlines` and many editors and tools
    would read as two lines, misaligning an output file with its references.

    Args:
      tokenizer: a `data.Tokenizer`.
      hypotheses: per sentence, output ids (as from `translate_ids`).

    Returns:
      The detokenized sentences, none containing a line break.
    """
    texts = (tokenizer.decode(ids) if len(ids) else "" for ids in hypotheses)
    return [" ".join(t.splitlines()) for t in texts]  # t itself when it has no line break


def encode_sources(tokenizer: Any, sentences: Sequence[str]) -> list[list[int]]:
    """Normalizes and tokenizes source sentences into `x + [eos]` (empty for an empty line).

    Args:
      tokenizer: a `data.Tokenizer`.
      sentences: raw source sentences.

    Returns:
      Per sentence, its source ids; `[]` where the normalized sentence is empty.
    """
    if isinstance(sentences, str):  # else each character would be a sentence
        raise TypeError("sentences must be a sequence of strings, got one str: pass [sentence]")
    normalized = [normalize(s) for s in sentences]
    encoded = tokenizer.encode_batch(normalized) if normalized else []
    return [
        ids + [tokenizer.eos_id] if text else []
        for text, ids in zip(normalized, encoded, strict=True)
    ]


class Run(NamedTuple):
    """A trained run, ready to translate.

    Attributes:
      model: `Transformer(config)` for the run's model config.
      params: the parameters (one checkpoint, or an average).
      tokenizer: the run's SentencePiece model (workdir/tokenizer.model).
      config: the run's config.json as a dict ("model", "data", "train").
      checkpoint: which parameters, in words (e.g. "step 3000 (best)").
    """

    model: Transformer
    params: Any
    tokenizer: Tokenizer
    config: dict[str, Any]
    checkpoint: str


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def load_model(workdir: str | os.PathLike) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """Loads what a workdir says about its model, without any parameters.

    Args:
      workdir: a run directory written by train.py.

    Returns:
      (model, tokenizer, config): `Transformer` for the run's model config, its
      SentencePiece model, and its config.json as a dict.

    Raises:
      checkpoints.CheckpointError: missing workdir or config, or a tokenizer other than
        the one config.json records.
      data.DataError: missing or mismatched tokenizer.
    """
    config = checkpoints.load_run_config(workdir)
    config_file = Path(workdir) / checkpoints.CONFIG_FILE
    try:
        model_config = TransformerConfig.from_dict(config["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise checkpoints.CheckpointError(
            f"{config_file}: bad model settings "
            f"({' '.join(str(e).split()) or type(e).__name__}); it was edited or written by "
            "another version of this project: restore the one its run wrote"
        ) from None
    tokenizer = Tokenizer.load(Path(workdir) / checkpoints.TOKENIZER_FILE)
    if tokenizer.vocab_size != model_config.vocab_size:
        raise DataError(
            f"{tokenizer.path} has {tokenizer.vocab_size} pieces but the model of "
            f"{config_file} has {model_config.vocab_size}: restore the tokenizer and config "
            "its run wrote"
        )
    checkpoints.check_run_tokenizer(workdir, config, tokenizer.fingerprint)
    return Transformer(model_config), tokenizer, config


def default_average_last(workdir: str | os.PathLike, config: dict | None = None) -> int:
    """How many checkpoints evaluate.py averages by default: the last DEFAULT_AVERAGE_LAST,
    or all the recent ones the run has if fewer.

    The run keeps its last `keep_checkpoints` plus the best, which may be far older:
    the average is of the recent ones only. 0 where the run has no checkpoint. `config`
    is the workdir's config.json where the caller has read it already.
    """
    available = len(checkpoints.checkpoint_steps(workdir))
    if config is None:
        config = checkpoints.load_run_config(workdir)
    return min(DEFAULT_AVERAGE_LAST, available, checkpoints.kept_last(config) or available)


def load_run(
    workdir: str | os.PathLike,
    *,
    checkpoint: str | int | None = None,
    average_last: int = 0,
    log: Callable[[str], None] = _warn,
) -> Run:
    """Loads a workdir written by train.py: model config, tokenizer and parameters.

    Args:
      workdir: the run directory.
      checkpoint: None for the parameters evaluate.py scores without flags (the
        average of `default_average_last(workdir)` checkpoints); "best" (highest
        validation BLEU), "last", or a step for one checkpoint.
      average_last: if > 0, average the parameters of the last `average_last`
        checkpoints instead (`checkpoint` is then ignored).
      log: receives one-line warnings.

    Returns:
      The run.

    Raises:
      checkpoints.CheckpointError: missing workdir, config or checkpoint.
      data.DataError: missing or mismatched tokenizer.
    """
    model, tokenizer, config = load_model(workdir)
    if checkpoint is None and average_last <= 0:
        average_last = default_average_last(workdir, config)
        checkpoint = "last"  # with no checkpoint at all, restore_chosen says what is missing
    if average_last > 0:
        trees, steps = checkpoints.restore_last(workdir, average_last, log=log)
        params = checkpoints.average_params(trees)
        description = f"average of steps {', '.join(map(str, steps))}"
    else:
        params, step, label = checkpoints.restore_chosen(workdir, checkpoint, log=log)
        description = f"step {step}" + (f" ({label})" if checkpoint in ("best", "last") else "")
    _check_params_fit(model, params, workdir)
    return Run(model, params, tokenizer, config, description)


def _check_params_fit(model: Transformer, params: Any, workdir: str | os.PathLike) -> None:
    """A one-line CheckpointError where the checkpoints' parameters do not have the
    shapes of the model that the workdir's config.json describes (an edited config)."""
    difference = checkpoints.shape_difference(params, _param_shapes(model))
    if difference:
        name, there, configured = difference
        raise checkpoints.CheckpointError(
            f"the checkpoints in {workdir} do not fit the model of its "
            f"{checkpoints.CONFIG_FILE}: parameter {name} is {there} there but {configured} "
            "by the config; restore the config its run wrote"
        )


@functools.lru_cache(maxsize=8)
def _param_shapes(model: Transformer) -> Any:
    """The shapes and dtypes of the model's parameters, traced once per model config in a
    process (modules compare by config; tracing `init` takes about half a second on a
    2-core CPU)."""
    token = jnp.ones((1, 1), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), token, token)["params"]
