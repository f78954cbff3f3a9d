"""Greedy and beam search for any encoder-decoder model, jit-compiled, with the decoding cache.

Both searches work with any Flax module that offers the model library's
interface (see `transformer.model.Transformer`):

  - `encode(src_BS) -> encoded_BSD`
  - `decode(encoded_BSD, src_BS, tgt_BT, decode=False) -> logits_BTV`
  - `init_cache(encoded_BSD, src_BS, max_decode_len)` creating a "cache"
    collection whose `cached_key`/`cached_value` leaves hold one row per
    decoded sequence, and whose other leaves (the scalar write positions, the
    cross-attention keys/values) are shared by all beams of a sentence.

The encoder runs once per batch and the cross-attention keys/values are
projected once per sentence (in `init_cache`); each step then feeds one new
token per hypothesis. With `use_cache=False` every step instead recomputes the
decoder over the whole prefix, which gives the same tokens (see the tests) and
is the baseline of `benchmarks/decode_speed.py`.

Lengths: sentence b may produce at most `len(src_b) + max_extra_len` tokens,
where `len(src_b)` counts its non-padding source tokens (end token included)
and the limit counts output tokens (end token included). A hypothesis that
reaches its limit without the end token is finished as it is. Output arrays
are `[batch, min(src_len + max_extra_len, max_len)]`: the generated tokens,
the end token included where one was produced, then `pad_id`.

The padding id is never generated (its log-probability is set to -inf): it
would be indistinguishable from padding, which the model's masks ignore.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

# Cache leaves that hold one row per hypothesis; every other leaf is per sentence or scalar.
PER_HYPOTHESIS_CACHE_LEAVES = ("cached_key", "cached_value")

_NEG_INF = -jnp.inf


def length_penalty(length: jax.Array | int, alpha: float) -> jax.Array:
    """GNMT length penalty lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al., 2016, eq. 14).

    Beam search ranks finished hypotheses by log P(Y | X) / lp(Y), where P is the
    model's distribution with the padding token left out (it is never generated).

    Args:
      length: hypothesis length(s) in tokens, end token included.
      alpha: strength; 0 ranks by plain log-probability.

    Returns:
      float32 array with the shape of `length`.
    """
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _check_integer(name: str, value: Any) -> None:
    """A length or a width given as a float (2.0) fails later as an unclear shape error."""
    try:
        operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _check_id(name: str, value: Any) -> None:
    """A float id failed deep inside JAX, and True passed as the id 1."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer token id, got {value!r}")
    _check_integer(name, value)


def _length_limits(
    src_BS: jax.Array, pad_id: int, max_extra_len: int, max_len: int | None
) -> tuple[jax.Array, int]:
    """Per-sentence output length limits [B] and the (static) buffer length for the batch."""
    _check_integer("max_extra_len", max_extra_len)
    if max_len is not None:
        _check_integer("max_len", max_len)
    src_len_B = jnp.sum(src_BS != pad_id, axis=1).astype(jnp.int32)
    limit_B = src_len_B + max_extra_len
    buffer_len = src_BS.shape[1] + max_extra_len
    if max_len is not None:
        limit_B = jnp.minimum(limit_B, max_len)
        buffer_len = min(buffer_len, max_len)
    if buffer_len < 1:
        cap = "" if max_len is None else f", at most max_len {max_len}"
        raise ValueError(
            f"the output length limit (src_len {src_BS.shape[1]} + max_extra_len "
            f"{max_extra_len}{cap}) must be at least 1, got {buffer_len}"
        )
    return limit_B, buffer_len


class _Decoder(NamedTuple):
    """One decoder step as three pure functions over an opaque state.

    init() -> state; step(state, tokens_N, t) -> (logits_NV, state), where
    tokens_N is the decoder input at position t; reorder(state, rows_N) makes
    row n continue the history of row rows_N[n].
    """

    init: Callable[[], Any]
    step: Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]
    reorder: Callable[[Any, jax.Array], Any]


def _cached_decoder(
    model: nn.Module, params: Any, encoded_BSD: jax.Array, src_BS: jax.Array, rows: int, length: int
) -> _Decoder:
    """Incremental decoding through the model's cache; `rows` hypotheses per sentence."""

    def init():
        _, variables = model.apply(
            {"params": params},
            encoded_BSD,
            src_BS,
            length,
            method="init_cache",
            mutable=["cache"],
        )

        # Only the self-attention buffers get a row per hypothesis; the
        # cross-attention keys/values stay one per sentence (the model regroups
        # the queries of a sentence's beams onto them).
        def expand(path, leaf):
            if rows > 1 and _leaf_name(path) in PER_HYPOTHESIS_CACHE_LEAVES:
                return jnp.repeat(leaf, rows, axis=0)
            return leaf

        return jax.tree_util.tree_map_with_path(expand, variables["cache"])

    def step(cache, tokens_N, t):
        del t  # the cache keeps its own write position
        logits_N1V, variables = model.apply(
            {"params": params, "cache": cache},
            encoded_BSD,
            src_BS,
            tokens_N[:, None],
            decode=True,
            method="decode",
            mutable=["cache"],
        )
        return logits_N1V[:, 0], variables["cache"]

    def reorder(cache, rows_N):
        def gather(path, leaf):
            if _leaf_name(path) in PER_HYPOTHESIS_CACHE_LEAVES:
                return jnp.take(leaf, rows_N, axis=0)
            return leaf

        return jax.tree_util.tree_map_with_path(gather, cache)

    return _Decoder(init, step, reorder)


def _uncached_decoder(
    model: nn.Module,
    params: Any,
    encoded_BSD: jax.Array,
    src_BS: jax.Array,
    rows: int,
    length: int,
    pad_id: int,
) -> _Decoder:
    """Recomputes the decoder over the whole prefix at every step (the baseline).

    Shapes are static under jit, so each step runs the decoder over a buffer
    of `length` positions; the causal mask hides the positions after t.
    """

    def init():
        return jnp.full((src_BS.shape[0] * rows, length), pad_id, jnp.int32)

    def step(prefix_NL, tokens_N, t):
        prefix_NL = jax.lax.dynamic_update_index_in_dim(prefix_NL, tokens_N, t, axis=1)
        logits_NLV = model.apply(
            {"params": params}, encoded_BSD, src_BS, prefix_NL, method="decode"
        )
        return jax.lax.dynamic_index_in_dim(logits_NLV, t, axis=1, keepdims=False), prefix_NL

    def reorder(prefix_NL, rows_N):
        return jnp.take(prefix_NL, rows_N, axis=0)

    return _Decoder(init, step, reorder)


def _leaf_name(path) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))


def _make_decoder(model, params, src_BS, rows, length, pad_id, use_cache):
    encoded_BSD = model.apply({"params": params}, src_BS, method="encode")
    if use_cache:
        return _cached_decoder(model, params, encoded_BSD, src_BS, rows, length)
    return _uncached_decoder(model, params, encoded_BSD, src_BS, rows, length, pad_id)


def _check_search_arguments(
    model: nn.Module,
    src_BS: jax.Array,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    beams: int = 1,
    alpha: float = 0.0,
) -> None:
    """Raises ValueError for arguments that would search wrongly instead of failing.

    An id past the vocabulary embeds as NaN or never ends the search; a padding id
    other than the model's makes the length limits count padding as tokens. The
    others (a list of ids, a float id, alpha None) failed deep inside JAX.
    """
    if not hasattr(src_BS, "ndim") or not jnp.issubdtype(src_BS.dtype, jnp.integer):
        got = f"dtype {src_BS.dtype}" if hasattr(src_BS, "dtype") else type(src_BS).__name__
        raise ValueError(
            f"src_BS must be an int array [batch, src_len], got {got}: convert the ids "
            "with jnp.asarray(ids, jnp.int32)"
        )
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
        _check_id(name, value)
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 <= alpha < math.inf:
        raise ValueError(f"alpha must be a real number >= 0, got {alpha!r}")
    if src_BS.ndim != 2 or src_BS.shape[1] == 0:
        raise ValueError(
            f"src_BS must be [batch, src_len] with src_len >= 1, got shape {tuple(src_BS.shape)}"
        )
    _check_integer("beam_size", beams)
    if beams < 1:
        raise ValueError(f"beam_size must be at least 1, got {beams}")
    if pad_id in (bos_id, eos_id):
        raise ValueError(
            f"the padding id ({pad_id}) must differ from the start ({bos_id}) "
            f"and end ({eos_id}) ids"
        )
    config = getattr(model, "config", None)
    vocab_size = getattr(config, "vocab_size", None)
    if vocab_size is not None:
        for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
            if not 0 <= value < vocab_size:
                raise ValueError(f"{name} must be in [0, vocab_size {vocab_size}), got {value}")
    model_pad_id = getattr(config, "pad_id", pad_id)
    if pad_id != model_pad_id:
        raise ValueError(
            f"pad_id {pad_id} is not the model's padding id (config.pad_id {model_pad_id})"
        )


def _previous_tokens(tokens_NL: jax.Array, t: jax.Array, bos_id: int) -> jax.Array:
    """The decoder input at position t: the start token, then the token produced at t - 1."""
    previous_N = jax.lax.dynamic_index_in_dim(tokens_NL, jnp.maximum(t - 1, 0), 1, keepdims=False)
    return jnp.where(t == 0, bos_id, previous_N)


@functools.partial(
    jax.jit,
    static_argnames=(
        "model",
        "bos_id",
        "eos_id",
        "pad_id",
        "max_extra_len",
        "max_len",
        "use_cache",
    ),
)
def greedy_search(
    model: nn.Module,
    params: Any,
    src_BS: jax.Array,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int = 0,
    max_extra_len: int = 50,
    max_len: int | None = None,
    use_cache: bool = True,
) -> jax.Array:
    """Picks the most probable next token at every step until the end token.

    Runs inside one `lax.while_loop` that stops as soon as every sentence has
    produced the end token or reached its length limit.

    Args:
      model: the encoder-decoder module (static: hashable, e.g. `Transformer(config)`).
      params: its parameters.
      src_BS: int source ids [batch, src_len], `pad_id` on the right, each in [0,
        vocab_size): not checked here, where they are traced (an id past the vocabulary
        embeds as NaN); `translate.translate_ids` checks them.
      bos_id: start token fed to the decoder first (from the tokenizer).
      eos_id: end token (from the tokenizer).
      pad_id: padding token; never generated.
      max_extra_len: sentence b produces at most len(src_b) + max_extra_len
        tokens, where len(src_b) counts its non-padding tokens.
      max_len: optional cap on every sentence's output length.
      use_cache: False recomputes the decoder over the whole prefix each step.

    Returns:
      int32 tokens [batch, L], L = min(src_len + max_extra_len, max_len): the
      generated tokens without the start token, the end token included where
      one was produced, then `pad_id`.
    """
    _check_search_arguments(model, src_BS, bos_id, eos_id, pad_id)
    batch = src_BS.shape[0]
    limit_B, length = _length_limits(src_BS, pad_id, max_extra_len, max_len)
    decoder = _make_decoder(model, params, src_BS, 1, length, pad_id, use_cache)

    def not_done(carry):
        t, _, _, finished_B = carry
        return (t < length) & ~jnp.all(finished_B)

    def body(carry):
        t, state, tokens_BL, finished_B = carry
        logits_BV, state = decoder.step(state, _previous_tokens(tokens_BL, t, bos_id), t)
        token_B = jnp.argmax(logits_BV.at[:, pad_id].set(_NEG_INF), axis=-1).astype(jnp.int32)
        token_B = jnp.where(finished_B, pad_id, token_B)
        tokens_BL = jax.lax.dynamic_update_index_in_dim(tokens_BL, token_B, t, axis=1)
        finished_B = finished_B | (token_B == eos_id) | (t + 1 >= limit_B)
        return t + 1, state, tokens_BL, finished_B

    carry = (
        jnp.array(0, jnp.int32),
        decoder.init(),
        jnp.full((batch, length), pad_id, jnp.int32),
        limit_B <= 0,  # a sentence allowed no token (all padding, max_extra_len 0) gets none
    )
    return jax.lax.while_loop(not_done, body, carry)[2]


@functools.partial(
    jax.jit,
    static_argnames=(
        "model",
        "bos_id",
        "eos_id",
        "pad_id",
        "beam_size",
        "alpha",
        "max_extra_len",
        "max_len",
        "use_cache",
    ),
)
def beam_search(
    model: nn.Module,
    params: Any,
    src_BS: jax.Array,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int = 0,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_extra_len: int = 50,
    max_len: int | None = None,
    use_cache: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Beam search with the GNMT length penalty, as in the paper (beam 4, alpha 0.6).

    Each step extends the `beam_size` alive hypotheses of a sentence by every
    token. Extensions that end compete for the best finished hypothesis by
    log P / lp(length): the end token where it is among the `beam_size` most
    probable extensions of the sentence at that step (fairseq's rule; finishing
    every end token, however improbable, finds outputs of higher log P that
    are too short, even empty, for small alpha), and every extension at the
    sentence's length limit. The other extensions compete for the `beam_size`
    alive slots by log P. A sentence is done when no alive hypothesis can
    still beat its best finished one (log P only falls as a hypothesis grows,
    so log P / max lp over the reachable lengths bounds its final score),
    which returns the same best hypothesis as searching on to the length
    limit. The `lax.while_loop` stops when every sentence is done.

    With beam_size 1 and alpha 0 this is greedy search; with alpha > 0 a
    single beam may go on past a probable end token to a longer hypothesis
    with a better normalized score.

    Args:
      model: the encoder-decoder module (static: hashable, e.g. `Transformer(config)`).
      params: its parameters.
      src_BS: int source ids [batch, src_len], `pad_id` on the right, each in [0,
        vocab_size): not checked here, where they are traced (an id past the vocabulary
        embeds as NaN); `translate.translate_ids` checks them.
      bos_id: start token fed to the decoder first (from the tokenizer).
      eos_id: end token (from the tokenizer).
      pad_id: padding token; never generated.
      beam_size: hypotheses kept alive per sentence.
      alpha: length penalty strength (0.6 in the paper; 0 = plain log P).
      max_extra_len: sentence b produces at most len(src_b) + max_extra_len
        tokens, where len(src_b) counts its non-padding tokens.
      max_len: optional cap on every sentence's output length.
      use_cache: False recomputes the decoder over the whole prefix each step.

    Returns:
      (tokens [batch, L] int32, L = min(src_len + max_extra_len, max_len): the
       best hypothesis without the start token, the end token included where
       one was produced, then `pad_id`;
       scores [batch] float32: its log P(Y | X) / lp(|Y|), P renormalized without
       the padding token, -inf for a sentence whose limit allows no token).
    """
    _check_search_arguments(model, src_BS, bos_id, eos_id, pad_id, beam_size, alpha)
    batch, beams = src_BS.shape[0], beam_size
    limit_B, length = _length_limits(src_BS, pad_id, max_extra_len, max_len)
    decoder = _make_decoder(model, params, src_BS, beams, length, pad_id, use_cache)
    # Row of the flattened [batch * beams] state that holds beam k of sentence b.
    first_row_B1 = (jnp.arange(batch) * beams)[:, None]

    def not_done(carry):
        t, done_B = carry[0], carry[-1]
        return (t < length) & ~jnp.all(done_B)

    def body(carry):
        t, state, alive_BKL, alive_logp_BK, best_BL, best_score_B, done_B = carry
        inputs_N = _previous_tokens(alive_BKL.reshape(batch * beams, length), t, bos_id)
        logits_NV, state = decoder.step(state, inputs_N, t)
        logp_NV = jax.nn.log_softmax(logits_NV.at[:, pad_id].set(_NEG_INF), axis=-1)
        vocab = logp_NV.shape[-1]
        candidate_BKV = alive_logp_BK[:, :, None] + logp_NV.reshape(batch, beams, vocab)

        is_eos_V = jnp.arange(vocab) == eos_id
        at_limit_B = t + 1 >= limit_B

        # Extensions that go on compete for the alive beams.
        going_BX = jnp.where(
            is_eos_V[None, None, :] | at_limit_B[:, None, None], _NEG_INF, candidate_BKV
        ).reshape(batch, beams * vocab)
        # The barrier keeps XLA from fusing a slice of the sorted scores into a
        # later op: on CPU that blocks the rewrite of top_k's sort into the fast
        # TopK call, and a full sort of [batch, beams * vocab] made each step ~6x slower.
        going_logp_BK, top_BK = jax.lax.optimization_barrier(jax.lax.top_k(going_BX, beams))

        # Extensions that end here: by an end token among the `beams` most probable
        # extensions of the sentence, or by reaching the limit. An end token's rank
        # among all extensions: the going ones above it (if `beams` of them are, the
        # top `beams` are) plus the end tokens above it.
        eos_logp_BK = candidate_BKV[:, :, eos_id]
        above_BK = jnp.sum(going_logp_BK[:, None, :] > eos_logp_BK[:, :, None], axis=-1)
        above_BK += jnp.sum(eos_logp_BK[:, None, :] > eos_logp_BK[:, :, None], axis=-1)
        finishes_BK = above_BK < beams
        ends_BKV = (is_eos_V[None, None, :] & finishes_BK[:, :, None]) | at_limit_B[:, None, None]
        ended_BX = jnp.where(ends_BKV, candidate_BKV / length_penalty(t + 1, alpha), _NEG_INF)
        ended_BX = ended_BX.reshape(batch, beams * vocab)
        top_ended_B = jnp.argmax(ended_BX, axis=-1)
        top_ended_score_B = jnp.max(ended_BX, axis=-1)
        ended_seq_BL = jnp.take_along_axis(alive_BKL, (top_ended_B // vocab)[:, None, None], 1)[
            :, 0
        ]
        ended_seq_BL = jax.lax.dynamic_update_index_in_dim(
            ended_seq_BL, (top_ended_B % vocab).astype(jnp.int32), t, axis=1
        )
        better_B = top_ended_score_B > best_score_B
        best_BL = jnp.where(better_B[:, None], ended_seq_BL, best_BL)
        best_score_B = jnp.where(better_B, top_ended_score_B, best_score_B)

        alive_logp_BK, parent_BK = going_logp_BK, top_BK // vocab
        alive_BKL = jnp.take_along_axis(alive_BKL, parent_BK[:, :, None], axis=1)
        alive_BKL = jax.lax.dynamic_update_index_in_dim(
            alive_BKL, (top_BK % vocab).astype(jnp.int32), t, axis=2
        )
        state = decoder.reorder(state, (first_row_B1 + parent_BK).reshape(-1))

        # The best reachable score of an alive hypothesis: log P (<= 0) can only fall,
        # and lp only grows with the length (alpha >= 0), so lp at the limit bounds it.
        bound_B = alive_logp_BK[:, 0] / length_penalty(limit_B, alpha)
        done_B = done_B | (t + 1 >= limit_B) | (bound_B <= best_score_B)
        alive_logp_BK = jnp.where(done_B[:, None], _NEG_INF, alive_logp_BK)
        return t + 1, state, alive_BKL, alive_logp_BK, best_BL, best_score_B, done_B

    # Beam 0 starts alone: the others would only duplicate it. A sentence allowed no
    # token (all padding with max_extra_len 0) starts done, with no hypothesis.
    none_allowed_B = limit_B <= 0
    alive_logp_BK = jnp.full((batch, beams), _NEG_INF).at[:, 0].set(0.0)
    alive_logp_BK = jnp.where(none_allowed_B[:, None], _NEG_INF, alive_logp_BK)
    carry = (
        jnp.array(0, jnp.int32),
        decoder.init(),
        jnp.full((batch, beams, length), pad_id, jnp.int32),
        alive_logp_BK,
        jnp.full((batch, length), pad_id, jnp.int32),
        jnp.full((batch,), _NEG_INF, jnp.float32),
        none_allowed_B,
    )
    carry = jax.lax.while_loop(not_done, body, carry)
    return carry[4], carry[5]
