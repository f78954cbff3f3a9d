"""The encoder-decoder Transformer of "Attention Is All You Need" as Flax linen modules."""

from __future__ import annotations

import operator
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from transformer.attention import MultiHeadAttention, check_cache_creation, creating_cache
from transformer.config import TransformerConfig
from transformer.dropout import Dropout
from transformer.matmul import dense_dot_general, matmul_transposed


def _positional_encoding_at(positions_L: jax.Array, d_model: int) -> jax.Array:
    """Sinusoidal encodings of arbitrary (possibly traced) positions, [L, d_model] float32."""
    # Dimension pair (2i, 2i+1) shares the wavelength 10000^(2i / d_model).
    two_i = np.arange(0, d_model, 2, dtype=np.float32)
    inv_wavelength = jnp.asarray(1.0 / np.power(10000.0, two_i / d_model), jnp.float32)
    angles_LI = positions_L.astype(jnp.float32)[:, None] * inv_wavelength[None, :]
    # Interleave so that even dimensions get sin and odd dimensions get cos.
    pe_LI2 = jnp.stack([jnp.sin(angles_LI), jnp.cos(angles_LI)], axis=-1)
    return pe_LI2.reshape(positions_L.shape[0], 2 * two_i.size)[:, :d_model]


def sinusoidal_positional_encoding(length: int, d_model: int) -> jax.Array:
    """The paper's positional encoding (section 3.5).

    PE[pos, 2i] = sin(pos / 10000^(2i/d_model)),
    PE[pos, 2i+1] = cos(pos / 10000^(2i/d_model)).

    Args:
      length: number of positions.
      d_model: encoding width.

    Returns:
      [length, d_model] float32.
    """
    return _positional_encoding_at(jnp.arange(length), d_model)


def padding_mask(tokens_BL: jax.Array, pad_id: int) -> jax.Array:
    """Boolean key mask [batch, 1, 1, len]: True on real (non-padding) tokens."""
    if jnp.ndim(tokens_BL) != 2:
        raise ValueError(f"tokens_BL must be [batch, len], got shape {jnp.shape(tokens_BL)}")
    return (tokens_BL != pad_id)[:, None, None, :]


def causal_mask(length: int) -> jax.Array:
    """Boolean [1, 1, length, length]: query t may attend to keys 0..t."""
    return jnp.tril(jnp.ones((length, length), bool))[None, None]


def _dense(features: int, cfg: TransformerConfig, name: str) -> nn.Dense:
    return nn.Dense(
        features,
        dtype=cfg.compute_dtype,
        param_dtype=jnp.float32,
        kernel_init=nn.initializers.xavier_uniform(),
        dot_general=partial(dense_dot_general, operand_dtype=cfg.matmul_operand_dtype),
        name=name,
    )


class FeedForward(nn.Module):
    """Position-wise feed-forward network: FFN(x) = max(0, x W1 + b1) W2 + b2 (section 3.3).

    Attributes:
      config: uses d_model, d_ff and dtype.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        """Maps [batch, len, d_model] -> [batch, len, d_model]."""
        h_BLF = nn.relu(_dense(self.config.d_ff, self.config, "inner")(x_BLD))
        return _dense(self.config.d_model, self.config, "outer")(h_BLF)


class _SublayerConnection(nn.Module):
    """Residual connection with layer norm and dropout around one sub-layer.

    Post-LN (paper): LayerNorm(x + Dropout(Sublayer(x))).
    Pre-LN:          x + Dropout(Sublayer(LayerNorm(x))).
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BLD: jax.Array, sublayer: Callable[[jax.Array], jax.Array], train: bool):
        norm = nn.LayerNorm(epsilon=1e-6, dtype=self.config.compute_dtype, name="norm")
        dropout = Dropout(self.config.dropout_rate, deterministic=not train)
        if self.config.pre_layer_norm:
            return x_BLD + dropout(sublayer(norm(x_BLD)))
        return norm(x_BLD + dropout(sublayer(x_BLD)))


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped in residual + layer norm.

    Attributes:
      config: the model config.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BSD: jax.Array, src_mask: jax.Array, *, train: bool = False) -> jax.Array:
        """Encodes one layer.

        Args:
          x_BSD: [batch, src_len, d_model].
          src_mask: boolean [batch, 1, 1, src_len], True on real source tokens.
          train: enables dropout.

        Returns:
          [batch, src_len, d_model].
        """
        cfg = self.config
        attention = MultiHeadAttention(cfg, name="self_attention")
        x_BSD = _SublayerConnection(cfg, name="attention_block")(
            x_BSD, lambda h: attention(h, None, src_mask, train=train), train
        )
        return _SublayerConnection(cfg, name="ffn_block")(
            x_BSD, FeedForward(cfg, name="ffn"), train
        )


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, feed-forward; each with residual + norm.

    Attributes:
      config: the model config.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        y_BTD: jax.Array,
        encoded_BSD: jax.Array,
        self_mask: jax.Array | None,
        cross_mask: jax.Array,
        *,
        train: bool = False,
        decode: bool = False,
    ) -> jax.Array:
        """Decodes one layer.

        Args:
          y_BTD: [batch, tgt_len, d_model] (tgt_len is 1 when decoding step by step).
          encoded_BSD: encoder output [batch, src_len, d_model].
          self_mask: boolean [batch, 1, tgt_len, tgt_len] (causal and target
            padding); None in cached decoding, where the cache supplies it.
          cross_mask: boolean [batch, 1, 1, src_len], True on real source tokens.
          train: enables dropout.
          decode: incremental decoding through the "cache" collection.

        Returns:
          [batch, tgt_len, d_model].
        """
        cfg = self.config
        self_attention = MultiHeadAttention(cfg, name="self_attention")
        cross_attention = MultiHeadAttention(cfg, name="cross_attention")
        y_BTD = _SublayerConnection(cfg, name="self_attention_block")(
            y_BTD, lambda h: self_attention(h, None, self_mask, train=train, decode=decode), train
        )
        y_BTD = _SublayerConnection(cfg, name="cross_attention_block")(
            y_BTD,
            lambda h: cross_attention(h, encoded_BSD, cross_mask, train=train, decode=decode),
            train,
        )
        return _SublayerConnection(cfg, name="ffn_block")(
            y_BTD, FeedForward(cfg, name="ffn"), train
        )


class _Embedding(nn.Module):
    """Token embedding * sqrt(d_model) + positional encoding, then dropout (section 3.4, 3.5)."""

    config: TransformerConfig
    embed: nn.Embed

    @nn.compact
    def __call__(self, tokens_BL: jax.Array, positions_L: jax.Array, train: bool) -> jax.Array:
        cfg = self.config
        x_BLD = self.embed(tokens_BL) * jnp.sqrt(jnp.float32(cfg.d_model)).astype(cfg.compute_dtype)
        x_BLD = x_BLD + _positional_encoding_at(positions_L, cfg.d_model)[None].astype(x_BLD.dtype)
        return Dropout(cfg.dropout_rate, deterministic=not train)(x_BLD)


def _check_ids(name: str, ids: jax.Array) -> None:
    """A ValueError unless `ids` is [batch, length] (rank errors were deep in the layers)."""
    if jnp.ndim(ids) != 2:
        raise ValueError(
            f"{name} must be token ids [batch, length], got shape {jnp.shape(ids)}"
            + (": add the batch axis (ids[None])" if jnp.ndim(ids) == 1 else "")
        )


class Encoder(nn.Module):
    """Embedding followed by a stack of `num_encoder_layers` EncoderLayers.

    Attributes:
      config: the model config.
      embed: the source token embedding (shared with the target when
        `config.share_embeddings`).
    """

    config: TransformerConfig
    embed: nn.Embed

    @nn.compact
    def __call__(self, src_BS: jax.Array, *, train: bool = False) -> jax.Array:
        """Encodes source token ids.

        Args:
          src_BS: int [batch, src_len], `config.pad_id` for padding.
          train: enables dropout.

        Returns:
          [batch, src_len, d_model].
        """
        cfg = self.config
        _check_ids("src_BS", src_BS)
        src_mask = padding_mask(src_BS, cfg.pad_id)
        x_BSD = _Embedding(cfg, self.embed, name="embedding")(
            src_BS, jnp.arange(src_BS.shape[1]), train
        )
        for i in range(cfg.num_encoder_layers):
            x_BSD = EncoderLayer(cfg, name=f"layer_{i}")(x_BSD, src_mask, train=train)
        if cfg.pre_layer_norm:
            x_BSD = nn.LayerNorm(epsilon=1e-6, dtype=cfg.compute_dtype, name="final_norm")(x_BSD)
        return x_BSD


class Decoder(nn.Module):
    """Embedding, a stack of `num_decoder_layers` DecoderLayers and the output projection.

    Attributes:
      config: the model config.
      embed: the target token embedding; its transpose is the pre-softmax
        projection when `config.share_embeddings`.
    """

    config: TransformerConfig
    embed: nn.Embed

    @nn.compact
    def __call__(
        self,
        encoded_BSD: jax.Array,
        src_BS: jax.Array,
        tgt_BT: jax.Array,
        *,
        train: bool = False,
        decode: bool = False,
        beams: int | None = 1,
    ) -> jax.Array:
        """Computes next-token logits.

        Args:
          encoded_BSD: encoder output [batch, src_len, d_model].
          src_BS: int source ids [batch, src_len] (for the source padding mask).
          tgt_BT: int decoder input ids [batch, tgt_len]: the target shifted
            right behind the start token.
          train: enables dropout.
          decode: incremental decoding: `tgt_BT` holds the next position(s) (tgt_len
            1 in the searches; more feed a forced prefix in one step, without
            padding, which a cached step does not mask) and the "cache" collection
            holds the past, created first by a call on a dummy target of length
            max_decode_len in `init` or inside `transformer.attention.creating_cache()`
            (a step without it is a ValueError).
          beams: rows of `tgt_BT` per source sentence outside `decode` (beam
            search; a sentence's rows adjacent, as `jnp.repeat` orders them):
            another target batch than `beams` times the source's is a ValueError,
            as a mismatch would otherwise pair row i with sentence i // r. None
            accepts any whole number per sentence (`Transformer.decode`). Cached
            steps pair the rows with the cache as `MultiHeadAttention` says.

        Returns:
          float32 logits [batch, tgt_len, vocab_size].
        """
        cfg = self.config
        _check_ids("src_BS", src_BS)
        _check_ids("tgt_BT", tgt_BT)
        if jnp.shape(encoded_BSD)[:2] != jnp.shape(src_BS):
            raise ValueError(
                f"encoded_BSD {jnp.shape(encoded_BSD)} is not the encoding of src_BS "
                f"{jnp.shape(src_BS)}: the two must have the same [batch, src_len]"
            )
        if not decode and beams is not None and tgt_BT.shape[0] != beams * src_BS.shape[0]:
            raise ValueError(
                f"tgt_BT has {tgt_BT.shape[0]} rows for {src_BS.shape[0]} source sentences: "
                f"give the target {beams} row(s) per sentence (beam search: pass beams=r "
                "for r rows per sentence, a sentence's rows adjacent)"
            )
        cross_mask = padding_mask(src_BS, cfg.pad_id)
        if decode:
            self_mask = None
            started = self.has_variable("cache", "position")
            if not started:
                check_cache_creation(self)
            position = self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
            positions_T = position.value + jnp.arange(tgt_BT.shape[1])
            if started:
                position.value = position.value + tgt_BT.shape[1]
        else:
            self_mask = causal_mask(tgt_BT.shape[1]) & padding_mask(tgt_BT, cfg.pad_id)
            positions_T = jnp.arange(tgt_BT.shape[1])
        y_BTD = _Embedding(cfg, self.embed, name="embedding")(tgt_BT, positions_T, train)
        for i in range(cfg.num_decoder_layers):
            y_BTD = DecoderLayer(cfg, name=f"layer_{i}")(
                y_BTD, encoded_BSD, self_mask, cross_mask, train=train, decode=decode
            )
        if cfg.pre_layer_norm:
            y_BTD = nn.LayerNorm(epsilon=1e-6, dtype=cfg.compute_dtype, name="final_norm")(y_BTD)
        if cfg.share_embeddings:
            y_BTD, embedding_VD = self.embed.promote_dtype(
                y_BTD, self.embed.embedding, dtype=self.embed.dtype
            )
            # Embed.attend's product.
            logits_BTV = matmul_transposed(y_BTD, embedding_VD, cfg.matmul_operand_dtype)
        else:
            logits_BTV = _dense(cfg.vocab_size, cfg, "output_projection")(y_BTD)
        return logits_BTV.astype(jnp.float32)


class Transformer(nn.Module):
    """The encoder-decoder Transformer (Vaswani et al., 2017).

    Token id `config.pad_id` (0) is padding; every mask is derived from it.

    Example:
      model = Transformer(TransformerConfig.preset("base", vocab_size=37000))
      params = model.init(key, src_BS, tgt_BT)["params"]
      logits_BTV = model.apply({"params": params}, src_BS, tgt_BT)

    Attributes:
      config: the model config.
    """

    config: TransformerConfig

    def setup(self):
        cfg = self.config

        def embedding(name: str) -> nn.Embed:
            # Unit-variance embeddings after the sqrt(d_model) scaling.
            return nn.Embed(
                cfg.vocab_size,
                cfg.d_model,
                dtype=cfg.compute_dtype,
                param_dtype=jnp.float32,
                embedding_init=nn.initializers.normal(stddev=cfg.d_model**-0.5),
                name=name,
            )

        if cfg.share_embeddings:
            src_embed = tgt_embed = embedding("shared_embedding")
        else:
            src_embed, tgt_embed = embedding("source_embedding"), embedding("target_embedding")
        self.encoder = Encoder(cfg, src_embed)
        self.decoder = Decoder(cfg, tgt_embed)

    def encode(self, src_BS: jax.Array, *, train: bool = False) -> jax.Array:
        """Encodes source ids [batch, src_len] into [batch, src_len, d_model]."""
        return self.encoder(src_BS, train=train)

    def decode(
        self,
        encoded_BSD: jax.Array,
        src_BS: jax.Array,
        tgt_BT: jax.Array,
        *,
        train: bool = False,
        decode: bool = False,
    ) -> jax.Array:
        """Decoder logits given the encoder output.

        For beam search `tgt_BT` may have r rows per sentence while `src_BS` and
        `encoded_BSD` keep one: row i is sentence i // r's (beams adjacent, as
        `jnp.repeat(x, r, axis=0)` orders them, not `jnp.tile`). In a cached
        step the cache's `cached_key` and `cached_value` leaves must be repeated
        so too (`jnp.repeat(leaf, r, axis=0)`, as `transformer.decoding` does).

        Args:
          encoded_BSD: `encode(src_BS)`, [batch, src_len, d_model].
          src_BS: source ids [batch, src_len].
          tgt_BT: decoder input ids [batch, tgt_len] (target shifted right).
          train: enables dropout.
          decode: one cached step; call `init_cache` first (a step without its
            "cache" collection is a ValueError) and apply with that collection
            and `mutable=["cache"]` (without it, Flax's ModifyScopeVariableError).

        Returns:
          float32 logits [batch, tgt_len, vocab_size].
        """
        if (
            decode
            and not self.is_initializing()
            and "decoder" not in self.variables.get("cache", {})
        ):
            # Else the step would create a fresh cache at position 0, and every later
            # step would be wrong without an error.
            raise ValueError(
                "decode=True steps the cache that init_cache creates: apply "
                "method=Transformer.init_cache with mutable=['cache'] first, then pass its "
                "'cache' collection to every step (state['cache'] of the state it returns, "
                "not the state itself)"
            )
        return self.decoder(encoded_BSD, src_BS, tgt_BT, train=train, decode=decode, beams=None)

    def init_cache(self, encoded_BSD: jax.Array, src_BS: jax.Array, max_decode_len: int) -> None:
        """Creates the decoding cache; apply with `mutable=["cache"]`, keep the "cache" collection.

        Self-attention buffers are zeros of [batch, max_decode_len, heads,
        d_head]; cross-attention keys/values are projected from `encoded_BSD`
        here, once per sentence. The dummy decoder pass that creates them has
        unused outputs, which `jax.jit` removes.

        Args:
          encoded_BSD: encoder output [batch, src_len, d_model].
          src_BS: source ids [batch, src_len].
          max_decode_len: the most positions the decoder will be stepped; the
            logits of every step past it are NaN.
        """
        try:
            positions = operator.index(max_decode_len)
        except TypeError:
            positions = 0
        if positions < 1 or isinstance(max_decode_len, bool):
            # 8.0 failed deep in jnp.zeros; 0 made a cache whose first step was NaN.
            raise ValueError(f"max_decode_len must be an integer >= 1, got {max_decode_len!r}")
        dummy_BT = jnp.zeros((src_BS.shape[0], positions), jnp.int32)
        with creating_cache():
            self.decoder(encoded_BSD, src_BS, dummy_BT, decode=True)

    def __call__(self, src_BS: jax.Array, tgt_BT: jax.Array, *, train: bool = False) -> jax.Array:
        """Teacher-forced logits.

        Args:
          src_BS: source ids [batch, src_len].
          tgt_BT: decoder input ids [batch, tgt_len]: the target shifted right
            behind the start token.
          train: enables dropout; apply with `rngs={"dropout": key}`.

        Returns:
          float32 logits [batch, tgt_len, vocab_size].
        """
        _check_ids("src_BS", src_BS)
        _check_ids("tgt_BT", tgt_BT)
        if src_BS.shape[0] != tgt_BT.shape[0]:  # decode() alone takes r rows per sentence
            raise ValueError(
                f"src_BS and tgt_BT must have the same batch, got {src_BS.shape[0]} and "
                f"{tgt_BT.shape[0]}"
            )
        return self.decode(self.encode(src_BS, train=train), src_BS, tgt_BT, train=train)
