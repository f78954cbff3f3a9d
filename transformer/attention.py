"""Scaled dot-product and multi-head attention (paper section 3.2), with a decoding cache."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from functools import partial

import jax
import jax.numpy as jnp
from flax import linen as nn

from transformer.config import TransformerConfig
from transformer.dropout import dropout
from transformer.matmul import attend, attention_scores, dense_dot_general


def scaled_dot_product_attention(
    q_BQHD: jax.Array,
    k_BKHD: jax.Array,
    v_BKHD: jax.Array,
    mask: jax.Array | None = None,
    *,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    matmul_dtype: jnp.dtype | None = None,
) -> tuple[jax.Array, jax.Array]:
    """softmax(Q K^T / sqrt(d_k)) V, for every head at once.

    The softmax runs in float32 whatever the input dtype. Masked positions are
    excluded with `where` (not by adding -inf), and their weights are set to
    exactly zero, so a query whose keys are all masked gets a zero output
    instead of NaN.

    Args:
      q_BQHD: queries [batch, q_len, heads, d_k].
      k_BKHD: keys [batch, kv_len, heads, d_k].
      v_BKHD: values [batch, kv_len, heads, d_v].
      mask: boolean, with 4 axes broadcastable to [batch, heads, q_len, kv_len];
        True where a query may attend to a key. None attends everywhere.
      dropout_rate: dropout on the attention weights.
      dropout_rng: PRNG key for that dropout; None disables it.
      matmul_dtype: the dtype the two products' operands are rounded to (they
        accumulate in float32); None keeps them as they are.

    Returns:
      (output [batch, q_len, heads, d_v] in the dtype of v,
       weights [batch, heads, q_len, kv_len] in float32, rows summing to 1
       over unmasked keys, or to 0 where every key is masked).
    """
    for name, x in (("q_BQHD", q_BQHD), ("k_BKHD", k_BKHD), ("v_BKHD", v_BKHD)):
        if jnp.ndim(x) != 4:  # else einsum's "subscript 'bqhd'" error, deep in a layer
            raise ValueError(
                f"{name} must have 4 axes [batch, len, heads, d_head], got shape {jnp.shape(x)}"
            )
    if mask is not None and jnp.result_type(mask) != jnp.bool_:
        raise TypeError(
            f"mask must be boolean (True where a query may attend), got {jnp.result_type(mask)}: "
            "make a 0/1 mask boolean with .astype(bool); an additive 0/-inf mask is not "
            "supported (it would be read the other way round)"
        )
    if mask is not None and jnp.ndim(mask) != 4:
        # Broadcasting aligns the last axes: a [batch, kv_len] padding mask would be read
        # as [q_len, kv_len] (silently, where batch == q_len).
        raise ValueError(
            f"mask must have 4 axes [batch, heads, q_len, kv_len] (each may be 1), got shape "
            f"{jnp.shape(mask)}: a [batch, kv_len] padding mask is mask[:, None, None, :] "
            "(padding_mask), a [q_len, kv_len] one mask[None, None]"
        )
    d_k = q_BQHD.shape[-1]
    if q_BQHD.dtype == jnp.float16:
        # Q K^T, rounded to float16, can pass its largest value (65504) where Q K^T / sqrt(d_k)
        # does not, and inf becomes NaN in the softmax: scale the queries first.
        q_BQHD = q_BQHD / jnp.sqrt(jnp.float32(d_k)).astype(jnp.float16)
        scores_BHQK = attention_scores(q_BQHD, k_BKHD, matmul_dtype).astype(jnp.float32)
    else:  # the paper's order
        scores_BHQK = attention_scores(q_BQHD, k_BKHD, matmul_dtype).astype(jnp.float32)
        scores_BHQK = scores_BHQK / jnp.sqrt(jnp.float32(d_k))
    if mask is not None:
        scores_BHQK = jnp.where(mask, scores_BHQK, jnp.finfo(jnp.float32).min)
    weights_BHQK = jax.nn.softmax(scores_BHQK, axis=-1)
    if mask is not None:
        # A fully masked row has uniform softmax weights; zero them.
        weights_BHQK = jnp.where(mask, weights_BHQK, 0.0)
    attended_BHQK = weights_BHQK
    if dropout_rng is not None and dropout_rate > 0.0:
        attended_BHQK = dropout(weights_BHQK, dropout_rate, dropout_rng)
    out_BQHD = attend(attended_BHQK.astype(v_BKHD.dtype), v_BKHD, matmul_dtype)
    return out_BQHD, weights_BHQK


_CREATING_CACHE = contextvars.ContextVar("creating_cache", default=False)


@contextlib.contextmanager
def creating_cache() -> Iterator[None]:
    """Marks the calls made inside as the setup call that creates a decoding cache.

    A `decode=True` call of `MultiHeadAttention` or `Decoder` that finds no cache
    creates one only here or in `init` (`Transformer.init_cache` does this); anywhere
    else it is a ValueError. Only the Python call (the tracing) needs to be inside.
    """
    token = _CREATING_CACHE.set(True)
    try:
        yield
    finally:
        _CREATING_CACHE.reset(token)


def check_cache_creation(module: nn.Module) -> None:
    """A ValueError unless `module` may create its decoding cache (in `init` or `creating_cache`).

    Else a step would create a cache of its own length (1): the next step would be
    wrong and the one after NaN, without an error.
    """
    if not module.is_initializing() and not _CREATING_CACHE.get():
        raise ValueError(
            f"{type(module).__name__}(decode=True) found no cache to step: create it first "
            "with a call on a dummy target of length max_decode_len, in init or inside "
            "`with transformer.attention.creating_cache():` with mutable=['cache'] (as "
            "Transformer.init_cache does), then pass its 'cache' collection to every step"
        )


class MultiHeadAttention(nn.Module):
    """h parallel heads of scaled dot-product attention with projections W^Q, W^K, W^V, W^O.

    Used three ways: encoder self-attention (`inputs_kv=None`), decoder masked
    self-attention (`inputs_kv=None` with a causal mask), and encoder-decoder
    cross-attention (`inputs_kv` = encoder output).

    Incremental decoding (`decode=True`) keeps a "cache" collection:
      - self-attention: `cached_key`/`cached_value` [batch, max_decode_len,
        heads, d_head] and the scalar `cache_index`. The first call, made with
        a dummy target of length max_decode_len in `init` or inside
        `creating_cache()`, only creates them (a call elsewhere that finds no
        cache is a ValueError); each later call appends its positions (one per
        step in the searches; several at once feed a forced prefix) and attends
        to the positions written so far, causally among its own.
      - cross-attention: `cross_key`/`cross_value` [batch, src_len, heads,
        d_head], projected from the encoder output by the first call and read
        by every later one.

    Beams: whenever the queries' batch is a multiple r of the keys' and values'
    (cached or not), query row i attends to key/value row i // r: beam search's r
    beams per sentence, a sentence's beams adjacent (`jnp.repeat`, not
    `jnp.tile`), share one copy of the source keys and values. Nothing here tells
    that from a batch mismatch by mistake (4 queries against 2 keys):
    `Transformer.__call__` and `Decoder` outside cached decoding (unless given
    `beams`) check their batches.

    The attention weights [batch, heads, q_len, kv_len] are sown into the
    "intermediates" collection as `attention_weights`.

    Attributes:
      config: the model config (d_model, num_heads, dtype, attention dropout).
    """

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        inputs_q_BQD: jax.Array,
        inputs_kv_BKD: jax.Array | None = None,
        mask: jax.Array | None = None,
        *,
        train: bool = False,
        decode: bool = False,
    ) -> jax.Array:
        """Attends from `inputs_q` to `inputs_kv` (or to itself).

        Args:
          inputs_q_BQD: query-side input [batch, q_len, d_model].
          inputs_kv_BKD: key/value-side input [batch, kv_len, d_model]; None for
            self-attention.
          mask: boolean, with 4 axes broadcastable to [batch, heads, q_len, kv_len]
            (another number of axes is a ValueError). Cached
            self-attention steps ignore it and build their own; cached
            cross-attention steps still need the source padding mask.
          train: enables attention dropout (needs the "dropout" RNG).
          decode: incremental decoding with the cache described above.

        Returns:
          [batch, q_len, d_model].
        """
        for name, x in (("inputs_q_BQD", inputs_q_BQD), ("inputs_kv_BKD", inputs_kv_BKD)):
            if x is not None and jnp.ndim(x) != 3:
                raise ValueError(
                    f"{name} must have 3 axes [batch, len, d_model], got shape {jnp.shape(x)}"
                )
        cfg = self.config
        dtype = cfg.compute_dtype
        dot_general = partial(dense_dot_general, operand_dtype=cfg.matmul_operand_dtype)

        def project(name: str) -> nn.DenseGeneral:
            return nn.DenseGeneral(
                features=(cfg.num_heads, cfg.d_head),
                use_bias=cfg.attention_bias,
                dtype=dtype,
                param_dtype=jnp.float32,
                kernel_init=nn.initializers.xavier_uniform(),
                dot_general=dot_general,
                name=name,
            )

        q_BQHD = project("query")(inputs_q_BQD)
        is_cross = inputs_kv_BKD is not None

        if is_cross and decode and self.has_variable("cache", "cross_key"):
            k_BKHD = self.get_variable("cache", "cross_key")
            v_BKHD = self.get_variable("cache", "cross_value")
        else:
            kv_input = inputs_kv_BKD if is_cross else inputs_q_BQD
            k_BKHD = project("key")(kv_input)
            v_BKHD = project("value")(kv_input)
            if is_cross and decode:
                check_cache_creation(self)
                self.put_variable("cache", "cross_key", k_BKHD)
                self.put_variable("cache", "cross_value", v_BKHD)

        if decode and not is_cross:
            k_BKHD, v_BKHD, mask = self._update_self_attention_cache(k_BKHD, v_BKHD, mask)

        # Beam search: r beams per sentence query one copy of the source K/V.
        batch_q, len_q = q_BQHD.shape[:2]
        batch_kv = k_BKHD.shape[0]
        if batch_q != batch_kv and (batch_kv == 0 or batch_q % batch_kv):
            raise ValueError(
                f"the queries' batch ({batch_q}) is not a multiple of the keys' and values' "
                f"({k_BKHD.shape[0]}): give the target and the source the same batch (or, "
                "in beam search, r rows per source sentence, a sentence's rows adjacent)"
            )
        beams = batch_q // batch_kv if batch_kv else 1  # an empty batch is one beam
        if beams > 1:
            q_BQHD = q_BQHD.reshape(batch_kv, beams * len_q, *q_BQHD.shape[2:])

        dropout_rng = None
        if train and cfg.attention_dropout_rate > 0.0:
            dropout_rng = self.make_rng("dropout")
        out_BQHD, weights_BHQK = scaled_dot_product_attention(
            q_BQHD,
            k_BKHD,
            v_BKHD,
            mask,
            dropout_rate=cfg.attention_dropout_rate,
            dropout_rng=dropout_rng,
            matmul_dtype=cfg.matmul_operand_dtype,
        )
        if beams > 1:  # back to one row per query sentence, as documented
            heads, keys = weights_BHQK.shape[1], weights_BHQK.shape[-1]
            weights_BHQK = weights_BHQK.reshape(-1, heads, beams, len_q, keys)
            weights_BHQK = weights_BHQK.transpose(0, 2, 1, 3, 4).reshape(
                batch_q, heads, len_q, keys
            )
        self.sow("intermediates", "attention_weights", weights_BHQK)
        out_BQHD = out_BQHD.reshape(batch_q, len_q, *out_BQHD.shape[2:])
        return nn.DenseGeneral(
            features=cfg.d_model,
            axis=(-2, -1),
            use_bias=cfg.attention_bias,
            dtype=dtype,
            param_dtype=jnp.float32,
            kernel_init=nn.initializers.xavier_uniform(),
            dot_general=dot_general,
            name="out",
        )(out_BQHD)

    def _update_self_attention_cache(
        self, k_B1HD: jax.Array, v_B1HD: jax.Array, mask: jax.Array | None
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Writes this step's key/value into the cache; returns all keys/values so far.

        On the creating call (dummy target of length max_decode_len) nothing is
        written and the inputs pass through unchanged.
        """
        initialized = self.has_variable("cache", "cached_key")
        if not initialized:
            check_cache_creation(self)
        cached_key = self.variable("cache", "cached_key", jnp.zeros, k_B1HD.shape, k_B1HD.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, v_B1HD.shape, v_B1HD.dtype)
        cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not initialized:
            return k_B1HD, v_B1HD, mask
        index = cache_index.value
        # A write past the end would be clamped onto the last positions and give wrong
        # outputs silently; a NaN key there makes every output from then on NaN.
        fits = index + k_B1HD.shape[1] <= cached_key.value.shape[1]
        k_B1HD = jnp.where(fits, k_B1HD, jnp.nan)
        k_BLHD = jax.lax.dynamic_update_slice_in_dim(cached_key.value, k_B1HD, index, axis=1)
        v_BLHD = jax.lax.dynamic_update_slice_in_dim(cached_value.value, v_B1HD, index, axis=1)
        cached_key.value, cached_value.value = k_BLHD, v_BLHD
        cache_index.value = index + k_B1HD.shape[1]
        # Causality: each new query sees the positions written so far, itself included.
        positions_Q = index + jnp.arange(k_B1HD.shape[1])
        visible_QL = jnp.arange(k_BLHD.shape[1])[None, :] <= positions_Q[:, None]
        return k_BLHD, v_BLHD, visible_QL[None, None, :, :]
