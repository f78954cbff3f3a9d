"""Sentences in, translations out: normalize, tokenize, batch, search, detokenize.

The text side comes from the `data` package (normalization, the run's
SentencePiece tokenizer, length-sorted inference batches); the search is
`transformer.decoding`. Every special id is read from the tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import linen as nn
from tqdm import tqdm

from data import normalize
from data.batching import inference_batches
from transformer.decoding import beam_search, greedy_search


def _padded_rows(n: int) -> int:
    """Rows a batch of n sentences is padded to: a power of two, so few shapes compile."""
    return 1 << max(0, n - 1).bit_length()


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
      src_ids: per sentence, its source ids `x + [eos]`; an empty sequence
        (an empty input line) is not decoded and gives an empty output.
      bos_id: start token.
      eos_id: end token.
      pad_id: padding token.
      greedy: greedy search instead of beam search.
      beam_size: beam width (ignored when `greedy`).
      alpha: length penalty strength (ignored when `greedy`).
      max_extra_len: each output has at most len(source) + max_extra_len tokens.
      max_tokens: most padded source positions per batch.
      progress: show a tqdm progress bar over sentences.

    Returns:
      Per sentence, the output ids without the end token.
    """
    outputs: list[list[int]] = [[] for _ in src_ids]
    todo = [i for i, ids in enumerate(src_ids) if len(ids)]
    search_kw = dict(bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, max_extra_len=max_extra_len)
    batches = inference_batches(
        [np.asarray(src_ids[i], np.int32) for i in todo], max_tokens=max_tokens, pad_id=pad_id
    )
    with tqdm(total=len(todo), desc="decoding", unit="sent", disable=not progress) as bar:
        for indices, src_bS in batches:
            # Repeat the first sentence to a power-of-two batch: fewer shapes to
            # compile, and the copies finish with it, so no extra steps.
            rows = _padded_rows(len(indices))
            src_BS = np.concatenate([src_bS, np.repeat(src_bS[:1], rows - len(indices), 0)])
            if greedy:
                tokens_BL = greedy_search(model, params, src_BS, **search_kw)
            else:
                tokens_BL, _ = beam_search(
                    model, params, src_BS, beam_size=beam_size, alpha=alpha, **search_kw
                )
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
      max_tokens: most padded source positions per batch.
      progress: show a tqdm progress bar.

    Returns:
      The detokenized translations, one per input sentence, in input order.
    """
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
    return [tokenizer.decode(ids) if ids else "" for ids in hypotheses]


def encode_sources(tokenizer: Any, sentences: Sequence[str]) -> list[list[int]]:
    """Normalizes and tokenizes source sentences into `x + [eos]` (empty for an empty line).

    Args:
      tokenizer: a `data.Tokenizer`.
      sentences: raw source sentences.

    Returns:
      Per sentence, its source ids; `[]` where the normalized sentence is empty.
    """
    normalized = [normalize(s) for s in sentences]
    encoded = tokenizer.encode_batch(normalized) if normalized else []
    return [
        ids + [tokenizer.eos_id] if text else []
        for text, ids in zip(normalized, encoded, strict=True)
    ]
