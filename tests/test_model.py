"""Properties of the model library that users rely on, all checked under jax.jit."""

import functools
import json
import re

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from transformer import (
    Decoder,
    DecoderLayer,
    Encoder,
    EncoderLayer,
    MultiHeadAttention,
    Transformer,
    TransformerConfig,
    causal_mask,
    padding_mask,
    scaled_dot_product_attention,
    sinusoidal_positional_encoding,
)
from transformer.attention import creating_cache

VOCAB = 40


def _config(**overrides) -> TransformerConfig:
    return TransformerConfig.preset("tiny", vocab_size=VOCAB, **overrides)


def _batch(rng: np.random.Generator, batch: int = 3, src_len: int = 7, tgt_len: int = 6):
    """Random non-padding tokens (ids 1..VOCAB-1) with some padding on the right."""
    src = rng.integers(1, VOCAB, size=(batch, src_len))
    tgt = rng.integers(1, VOCAB, size=(batch, tgt_len))
    src[1, 5:] = 0
    tgt[2, 4:] = 0
    return jnp.asarray(src, jnp.int32), jnp.asarray(tgt, jnp.int32)


@functools.cache
def _compiled(config: TransformerConfig):
    """Model, jitted init and jitted logits for a config, compiled once per test session."""
    model = Transformer(config)
    init = jax.jit(model.init)
    logits = jax.jit(lambda p, s, t: model.apply({"params": p}, s, t))
    return model, init, logits


def _init(config: TransformerConfig, src, tgt, seed: int = 0):
    model, init, _ = _compiled(config)
    return model, init(jax.random.key(seed), src, tgt)["params"]


def _logits_fn(model):
    return _compiled(model.config)[2]


LAYOUTS = [dict(), dict(pre_layer_norm=True), dict(share_embeddings=False)]


@pytest.mark.parametrize("pre_layer_norm", [False, True])
def test_the_residual_connection_is_the_layout_the_config_names(pre_layer_norm):
    # Post-LN LN(x + F(x)), pre-LN x + F(LN(x)), the stacks ending with a LayerNorm in
    # pre-LN only: a residual taken from LN(x), or no final norm, passed every other test.
    from transformer.model import _SublayerConnection

    config = _config(pre_layer_norm=pre_layer_norm)
    x = np.random.default_rng(0).normal(2.0, 3.0, (2, 3, config.d_model)).astype(np.float32)
    block = _SublayerConnection(config)
    params = block.init(jax.random.key(0), x, lambda h: 2 * h + 1, False)
    out = np.asarray(block.apply(params, x, lambda h: 2 * h + 1, False))

    def norm(h):  # LayerNorm at its initial scale 1 and bias 0
        return (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-6)

    expected = x + (2 * norm(x) + 1) if pre_layer_norm else norm(x + (2 * x + 1))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    src, tgt = _batch(np.random.default_rng(0))
    model, model_params = _init(config, src, tgt)
    for stack in ("encoder", "decoder"):
        assert ("final_norm" in model_params[stack]) == pre_layer_norm, stack
    if not pre_layer_norm:
        return
    # Each stack's output is its final norm's: zeroed, it zeroes them (a norm made but not
    # applied passed the check above). Shared embeddings: zero decoder outputs, zero logits.
    logits = _logits_fn(model)
    other_src = jnp.where(src != 0, src % (VOCAB - 1) + 1, 0)  # other tokens, same padding
    assert not np.allclose(logits(model_params, src, tgt), logits(model_params, other_src, tgt))
    for stack in ("encoder", "decoder"):
        zeroed = jax.tree.map(lambda x: x, model_params)  # new containers, same arrays
        zeroed[stack]["final_norm"] = jax.tree.map(jnp.zeros_like, zeroed[stack]["final_norm"])
        if stack == "decoder":
            np.testing.assert_array_equal(logits(zeroed, src, tgt), 0.0)
        else:  # the decoder sees no source: every source gives the same logits
            np.testing.assert_allclose(
                logits(zeroed, src, tgt), logits(zeroed, other_src, tgt), atol=1e-6
            )


def test_the_embedding_is_scaled_by_sqrt_d_model_plus_positions_then_dropped_out():
    # Section 3.4: embedding * sqrt(d_model); 5.4: dropout on the sums with the positional
    # encodings. d_model in place of its root, or no dropout there (the layers' dropout
    # still varied the outputs), passed every other test.
    from transformer.model import _Embedding

    config = _config(dropout_rate=0.5)
    layer = _Embedding(config, flax.linen.Embed(VOCAB, config.d_model))
    tokens = jnp.asarray([[5, 9, 0, 3]])
    positions = jnp.arange(4) + 2
    variables = layer.init(jax.random.key(0), tokens, positions, False)
    table = variables["params"]["embed"]["embedding"]
    out = np.asarray(layer.apply(variables, tokens, positions, False))
    pe = sinusoidal_positional_encoding(6, config.d_model)[2:]
    expected = np.asarray(table)[np.asarray(tokens[0])] * np.sqrt(config.d_model) + pe
    np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-6)
    dropped = layer.apply(variables, tokens, positions, True, rngs={"dropout": jax.random.key(1)})
    kept = np.asarray(dropped) != 0
    assert 0.3 < kept.mean() < 0.7  # rate 0.5; the kept scaled by 1 / (1 - rate)
    np.testing.assert_allclose(np.asarray(dropped)[kept], 2 * out[kept], rtol=1e-5)


@pytest.mark.parametrize("overrides", LAYOUTS, ids=["post_ln", "pre_ln", "unshared"])
def test_decoder_is_causal(overrides):
    """Changing target tokens after position t never changes logits at positions <= t."""
    rng = np.random.default_rng(0)
    src, tgt = _batch(rng)
    model, params = _init(_config(**overrides), src, tgt)
    logits = _logits_fn(model)
    base = logits(params, src, tgt)
    for t in range(tgt.shape[1] - 1):
        changed = tgt.at[:, t + 1 :].set(jnp.asarray(rng.integers(1, VOCAB, (3, 5 - t))))
        after = logits(params, src, changed)
        np.testing.assert_allclose(after[:, : t + 1], base[:, : t + 1], atol=1e-5)
        # The future did change, and it matters to the later positions.
        assert not np.allclose(after[:, t + 1 :], base[:, t + 1 :], atol=1e-5)


@pytest.mark.parametrize("overrides", LAYOUTS, ids=["post_ln", "pre_ln", "unshared"])
def test_padding_does_not_change_real_positions(overrides):
    rng = np.random.default_rng(1)
    src, tgt = _batch(rng)
    model, params = _init(_config(**overrides), src, tgt)
    logits = _logits_fn(model)
    base = logits(params, src, tgt)
    padded_src = jnp.pad(src, ((0, 0), (0, 5)))
    padded_tgt = jnp.pad(tgt, ((0, 0), (0, 3)))
    padded = logits(params, padded_src, padded_tgt)
    real = np.asarray(tgt != 0)
    np.testing.assert_allclose(
        np.asarray(padded[:, : tgt.shape[1]])[real], np.asarray(base)[real], atol=1e-5
    )


def test_logits_shape_and_dtype():
    src, tgt = _batch(np.random.default_rng(2))
    model, params = _init(_config(), src, tgt)
    out = _logits_fn(model)(params, src, tgt)
    assert out.shape == (3, 6, VOCAB)
    assert out.dtype == jnp.float32


def test_positional_encoding_matches_the_paper_formula():
    length, d_model = 50, 64
    pe = np.asarray(jax.jit(sinusoidal_positional_encoding, static_argnums=(0, 1))(length, d_model))
    expected = np.zeros((length, d_model))
    for pos in range(length):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            expected[pos, 2 * i] = np.sin(angle)
            expected[pos, 2 * i + 1] = np.cos(angle)
    assert pe.shape == (length, d_model)
    np.testing.assert_allclose(pe, expected, atol=2e-5)


def test_positional_encoding_of_no_positions_is_empty():
    assert sinusoidal_positional_encoding(0, 8).shape == (0, 8)  # was a ZeroDivisionError


def test_attention_weights_are_a_distribution_over_unmasked_keys():
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 5, 3, 8)), jnp.float32) for _ in range(3))
    k_mask = np.ones((2, 5), bool)
    k_mask[0, 3:] = False
    k_mask[1, 0] = False
    mask = jnp.asarray(k_mask)[:, None, None, :]
    out, weights = jax.jit(scaled_dot_product_attention)(q, k, v, mask)
    weights = np.asarray(weights)
    assert weights.shape == (2, 3, 5, 5)
    assert (weights >= 0).all()
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
    assert (weights[0, :, :, 3:] == 0).all() and (weights[1, :, :, 0] == 0).all()
    # The output is the weighted mean of the values under those weights.
    np.testing.assert_allclose(out, np.einsum("bhqk,bkhd->bqhd", weights, v), atol=1e-5)
    # And the weights are the paper's, softmax(Q K^T / sqrt(d_k)) over the unmasked keys
    # (a division by d_k passed the checks above).
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8.0)
    scores = np.where(mask, scores, -np.inf)
    expected = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(weights, expected / expected.sum(-1, keepdims=True), atol=1e-6)


def test_fully_masked_query_gives_zeros_not_nan():
    q = k = v = jnp.ones((1, 2, 1, 4))
    mask = jnp.zeros((1, 1, 2, 2), bool)
    out, weights = jax.jit(scaled_dot_product_attention)(q, k, v, mask)
    assert np.isfinite(np.asarray(out)).all()
    assert (np.asarray(weights) == 0).all()


def test_an_additive_float_mask_is_a_type_error_not_a_mask_read_backwards():
    # 0 where allowed and -1e9 where masked, the other common convention, was taken as
    # "attend where nonzero": every query attended to the padding only.
    q = k = v = jnp.ones((1, 3, 1, 4))
    additive = jnp.where(jnp.array([True, True, False]), 0.0, -1e9)[None, None, None, :]
    with pytest.raises(TypeError, match="mask must be boolean"):
        scaled_dot_product_attention(q, k, v, additive)
    with pytest.raises(TypeError, match=r"make a 0/1 mask boolean with .astype\(bool\)"):
        scaled_dot_product_attention(q, k, v, (additive == 0).astype(jnp.float32))


def test_a_mask_without_four_axes_is_an_error_not_read_on_the_wrong_axes():
    # A [batch, kv_len] padding mask broadcast as [q_len, kv_len]: with batch == q_len,
    # sentence 0's second query attended to its padding and sentence 1's first did not.
    q = jnp.ones((2, 2, 1, 4))
    k = v = jnp.ones((2, 5, 1, 4))
    padding = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    with pytest.raises(ValueError, match=r"mask must have 4 axes .* got shape \(2, 5\)"):
        scaled_dot_product_attention(q, k, v, padding)
    _, weights = scaled_dot_product_attention(q, k, v, padding[:, None, None, :])
    assert (np.asarray(weights[0, :, :, 3:]) == 0).all() and (weights[1] > 0).all()


def test_inputs_of_another_rank_are_errors_that_name_the_argument_and_its_layout():
    # A forgotten batch axis failed in einsum ("subscript 'bqhd' does not contain the
    # correct number of indices"), or in indexing, naming neither the call nor the layout.
    x = jnp.ones((2, 5, 8))
    with pytest.raises(ValueError, match=r"q_BQHD must have 4 axes \[batch, len, heads, d_head"):
        scaled_dot_product_attention(x, x, x)
    layer = MultiHeadAttention(_config())
    params = layer.init(jax.random.key(0), jnp.ones((1, 5, 32)))
    with pytest.raises(ValueError, match=r"inputs_q_BQD must have 3 axes .* got shape \(5, 32\)"):
        layer.apply(params, jnp.ones((5, 32)))
    with pytest.raises(ValueError, match=r"inputs_kv_BKD must have 3 axes"):
        layer.apply(params, jnp.ones((1, 5, 32)), jnp.ones((5, 32)))
    with pytest.raises(ValueError, match=r"tokens_BL must be \[batch, len\], got shape \(3,\)"):
        padding_mask(jnp.array([5, 6, 0]), 0)


def test_a_decode_step_without_the_init_cache_collection_is_an_error():
    # It created a fresh cache at position 0: the first step was right and every later
    # one wrong, with no error.
    src, tgt = _batch(np.random.default_rng(7))
    model, params = _init(_config(), src, tgt)
    encoded = model.apply({"params": params}, src, method=Transformer.encode)
    with pytest.raises(ValueError, match="steps the cache that init_cache creates"):
        model.apply(
            {"params": params}, encoded, src, tgt[:, :1], decode=True,
            method=Transformer.decode, mutable=["cache"],
        )  # fmt: skip
    # init_cache's whole state in place of its "cache" collection: before, the step made a
    # fresh cache too (step 1 wrong, step 2 NaN).
    _, state = model.apply(
        {"params": params}, encoded, src, 4, method=Transformer.init_cache, mutable=["cache"]
    )
    with pytest.raises(ValueError, match=r"state\['cache'\] of the state it returns"):
        model.apply(
            {"params": params, "cache": state}, encoded, src, tgt[:, :1], decode=True,
            method=Transformer.decode, mutable=["cache"],
        )  # fmt: skip
    # Without mutable=["cache"]: Flax's own error, as the docstring says.
    with pytest.raises(flax.errors.ModifyScopeVariableError):
        model.apply(
            {"params": params, "cache": state["cache"]}, encoded, src, tgt[:, :1],
            decode=True, method=Transformer.decode,
        )  # fmt: skip


def _standalone_decoder(seed: int = 8):
    """A Decoder of its own, its variables, an encoding, sources and unpadded targets."""
    config = _config()
    rng = np.random.default_rng(seed)
    src, _ = _batch(rng)
    tgt = jnp.asarray(rng.integers(1, VOCAB, size=(3, 6)), jnp.int32)
    encoded = jnp.asarray(rng.normal(size=(*src.shape, config.d_model)), jnp.float32)
    decoder = Decoder(config, nn.Embed(VOCAB, config.d_model))
    return decoder, decoder.init(jax.random.key(0), encoded, src, tgt), encoded, src, tgt


def test_a_standalone_decoder_or_attention_step_without_a_cache_is_an_error():
    # The step created a cache of its own length (1): step 2 was wrong and step 3 NaN,
    # with no error.
    decoder, variables, encoded, src, tgt = _standalone_decoder()
    with pytest.raises(ValueError, match=r"Decoder\(decode=True\) found no cache to step"):
        decoder.apply(variables, encoded, src, tgt[:, :1], decode=True, mutable=["cache"])
    attention = MultiHeadAttention(_config())
    attention_vars = attention.init(jax.random.key(1), encoded, encoded)
    for kv in (None, encoded):  # self- and cross-attention
        with pytest.raises(ValueError, match=r"MultiHeadAttention\(decode=True\) found no"):
            attention.apply(attention_vars, encoded[:, :1], kv, decode=True, mutable=["cache"])
    # The cache created as documented: every step matches the full decoder.
    full = decoder.apply(variables, encoded, src, tgt)
    step = jax.jit(
        lambda cache, tok: decoder.apply(
            {**variables, "cache": cache}, encoded, src, tok, decode=True, mutable=["cache"]
        )
    )
    with creating_cache():
        _, state = decoder.apply(
            variables, encoded, src, jnp.zeros((3, 8), jnp.int32), decode=True, mutable=["cache"]
        )
    for t in range(tgt.shape[1]):
        logits, state = step(state["cache"], tgt[:, t : t + 1])
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5)


def test_a_decoder_given_another_target_batch_than_the_source_is_an_error():
    # 4 target rows for 2 sentences were taken as 2 beams each (row i read sentence
    # i // 2), silently; only a batch that is not a multiple (3 for 2) was caught.
    decoder, variables, encoded, src, tgt = _standalone_decoder()
    twice = jnp.concatenate([tgt[:2], tgt[:2]])
    with pytest.raises(ValueError, match="tgt_BT has 4 rows for 2 source sentences"):
        decoder.apply(variables, encoded[:2], src[:2], twice)
    # Asked for, beams pair a sentence's adjacent rows with it.
    full = decoder.apply(variables, encoded[:2], src[:2], tgt[:2])
    beamed = decoder.apply(variables, encoded[:2], src[:2], jnp.repeat(tgt[:2], 2, axis=0), beams=2)
    np.testing.assert_allclose(beamed, jnp.repeat(full, 2, axis=0), atol=1e-5)


def test_ids_of_another_rank_or_another_sentences_encoding_are_errors():
    # 1-D ids were "must have the same batch, got 7 and 6" (their lengths), or an
    # IndexError deep in the embedding; [B, S, 1] an einsum error. The encoding of other
    # sentences than src_BS's (another batch) decoded with the wrong padding masks.
    src, tgt = _batch(np.random.default_rng(7))
    model, params = _init(_config(), src, tgt)
    variables = {"params": params}
    with pytest.raises(ValueError, match=r"src_BS must be .* \(7,\): add the batch axis"):
        model.apply(variables, src[0], tgt[0])
    with pytest.raises(ValueError, match=r"tgt_BT must be token ids \[batch, length\]"):
        model.apply(variables, src, tgt[..., None])
    with pytest.raises(ValueError, match=r"src_BS must be .* got shape \(3, 7, 1\)(?!:)"):
        model.apply(variables, src[..., None], method=Transformer.encode)
    encoded = model.apply(variables, src, method=Transformer.encode)
    with pytest.raises(ValueError, match=r"\(3, 7, 32\) is not the encoding of src_BS \(1, 7\)"):
        model.apply(variables, encoded, src[:1], tgt, method=Transformer.decode)
    # A cache of no position made every step NaN; 8.0 failed deep in jnp.zeros.
    for length in (0, 8.0, True):
        with pytest.raises(
            ValueError, match=f"max_decode_len must be an integer >= 1, got {length}"
        ):
            model.apply(
                variables, encoded, src, length, method=Transformer.init_cache, mutable=["cache"]
            )


def test_attention_weights_are_recorded():
    src, tgt = _batch(np.random.default_rng(4))
    model, params = _init(_config(), src, tgt)
    _, state = jax.jit(lambda p: model.apply({"params": p}, src, tgt, mutable=["intermediates"]))(
        params
    )
    (cross,) = state["intermediates"]["decoder"]["layer_1"]["cross_attention"]["attention_weights"]
    assert cross.shape == (3, 4, 6, 7)  # [batch, heads, tgt_len, src_len]
    assert (np.asarray(cross)[1, :, :, 5:] == 0).all()  # source padding gets no attention


def test_base_preset_has_the_papers_parameter_count():
    """The paper reports 65M parameters for the base model (shared 37000-token vocabulary)."""
    config = TransformerConfig.preset("base", vocab_size=37000)
    tokens = jnp.ones((1, 4), jnp.int32)
    shapes = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens, tokens)
    count = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
    assert 60e6 < count < 66e6, count
    assert config.d_model == 512 and config.d_ff == 2048 and config.num_heads == 8
    # One layer more or less moves the count by about 3M only: N = 6 is checked as such.
    assert (config.num_encoder_layers, config.num_decoder_layers) == (6, 6)
    assert TransformerConfig(vocab_size=37000) == config  # the fields' defaults are `base`
    # The defaults the README's "Config choices" names: post-LN and shared embeddings as in
    # the paper, biases on W^Q, W^K, W^V and W^O (the paper's have none); no dropout on the
    # attention weights, as in the paper; padding id 0, which the tokenizer requires.
    assert not config.pre_layer_norm and config.share_embeddings and config.attention_bias
    assert config.attention_dropout_rate == 0.0 and config.pad_id == 0
    big = TransformerConfig.preset("big", vocab_size=37000)
    assert (big.d_model, big.d_ff, big.num_heads, big.dropout_rate) == (1024, 4096, 16, 0.3)
    assert (big.num_encoder_layers, big.num_decoder_layers) == (6, 6)


def _incremental_logits(model, params, src, tgt, max_decode_len):
    """Feeds tgt one position at a time through the cache; returns [B, T, V] logits."""

    @jax.jit
    def run(params, src, tgt):
        encoded = model.apply({"params": params}, src, method=Transformer.encode)
        _, state = model.apply(
            {"params": params},
            encoded,
            src,
            max_decode_len,
            method=Transformer.init_cache,
            mutable=["cache"],
        )

        def step(cache, tok_B):
            logits, state = model.apply(
                {"params": params, "cache": cache},
                encoded,
                src,
                tok_B[:, None],
                decode=True,
                method=Transformer.decode,
                mutable=["cache"],
            )
            return state["cache"], logits[:, 0]

        _, logits_TBV = jax.lax.scan(step, state["cache"], tgt.T)
        return jnp.swapaxes(logits_TBV, 0, 1)

    return run(params, src, tgt)


@pytest.mark.parametrize("overrides", LAYOUTS, ids=["post_ln", "pre_ln", "unshared"])
def test_incremental_decoding_matches_the_full_decoder(overrides):
    rng = np.random.default_rng(5)
    src, tgt = _batch(rng)
    tgt = tgt.at[2].set(jnp.asarray(rng.integers(1, VOCAB, 6)))  # no padding in the prefix
    model, params = _init(_config(**overrides), src, tgt)
    full = _logits_fn(model)(params, src, tgt)
    incremental = _incremental_logits(model, params, src, tgt, max_decode_len=10)
    np.testing.assert_allclose(incremental, full, atol=1e-5)


def test_a_cached_step_may_take_several_positions_at_once():
    # A forced prefix can be fed in one cached step: each chunk is written at the
    # cache's index, its queries are placed and masked from there, and the next step
    # starts after the chunk's last position, so the logits are the full decoder's.
    rng = np.random.default_rng(5)
    src, tgt = _batch(rng)
    tgt = tgt.at[2].set(jnp.asarray(rng.integers(1, VOCAB, 6)))  # a prefix has no padding
    model, params = _init(_config(), src, tgt)
    full = _logits_fn(model)(params, src, tgt)
    encoded = model.apply({"params": params}, src, method=Transformer.encode)
    _, state = model.apply(
        {"params": params}, encoded, src, 10, method=Transformer.init_cache, mutable=["cache"]
    )
    chunks = []
    for start, stop in [(0, 3), (3, 4), (4, 6)]:
        logits, state = model.apply(
            {"params": params, "cache": state["cache"]},
            encoded,
            src,
            tgt[:, start:stop],
            decode=True,
            method=Transformer.decode,
            mutable=["cache"],
        )
        chunks.append(logits)
    np.testing.assert_allclose(jnp.concatenate(chunks, axis=1), full, atol=1e-5)


def test_stepping_past_the_cache_gives_nan_not_wrong_logits():
    rng = np.random.default_rng(5)
    src, tgt = _batch(rng)
    model, params = _init(_config(), src, tgt)
    full = _logits_fn(model)(params, src, tgt)
    incremental = _incremental_logits(model, params, src, tgt, max_decode_len=4)
    np.testing.assert_allclose(incremental[:, :4], full[:, :4], atol=1e-5)
    assert np.isnan(incremental[:, 4:]).all()


def test_cross_attention_cache_is_shared_by_beams():
    """Decoding r adjacent copies of each sentence against the un-expanded cache equals
    decoding each sentence on its own, and the cross-attention cache keeps batch B."""
    rng = np.random.default_rng(6)
    src, tgt = _batch(rng)
    model, params = _init(_config(), src, tgt)
    encoded = model.apply({"params": params}, src, method=Transformer.encode)
    _, state = model.apply(
        {"params": params}, encoded, src, 4, method=Transformer.init_cache, mutable=["cache"]
    )
    cache = state["cache"]
    layer = cache["decoder"]["layer_0"]
    assert layer["cross_attention"]["cross_key"].shape[0] == 3
    beams = 2

    def expand(path, x):
        name = path[-1].key
        return jnp.repeat(x, beams, axis=0) if name in ("cached_key", "cached_value") else x

    beam_cache = jax.tree_util.tree_map_with_path(expand, cache)
    tok = tgt[:, :1]
    single, _ = model.apply(
        {"params": params, "cache": cache},
        encoded,
        src,
        tok,
        decode=True,
        method=Transformer.decode,
        mutable=["cache"],
    )
    beamed, _ = model.apply(
        {"params": params, "cache": beam_cache},
        encoded,
        src,
        jnp.repeat(tok, beams, axis=0),
        decode=True,
        method=Transformer.decode,
        mutable=["cache"],
    )
    np.testing.assert_allclose(beamed, jnp.repeat(single, beams, axis=0), atol=1e-6)


def test_dropout_only_in_training():
    src, tgt = _batch(np.random.default_rng(7))
    model, params = _init(_config(dropout_rate=0.3), src, tgt)

    @jax.jit
    def train_logits(params, key):
        return model.apply({"params": params}, src, tgt, train=True, rngs={"dropout": key})

    # Not training: the same logits as the same parameters without dropout.
    without = _logits_fn(Transformer(_config(dropout_rate=0.0)))(params, src, tgt)
    np.testing.assert_array_equal(_logits_fn(model)(params, src, tgt), without)
    a = train_logits(params, jax.random.key(1))
    b = train_logits(params, jax.random.key(2))
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(a, train_logits(params, jax.random.key(1)))


def test_attention_dropout_is_applied_in_training():
    config = _config(dropout_rate=0.0, attention_dropout_rate=0.5)
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.normal(size=(2, 5, config.d_model)), jnp.float32)
    mha = MultiHeadAttention(config)
    params = mha.init(jax.random.key(0), x)["params"]
    apply = jax.jit(lambda key: mha.apply({"params": params}, x, train=True, rngs={"dropout": key}))
    assert not np.allclose(apply(jax.random.key(1)), apply(jax.random.key(2)))
    # The weights it sows (for the plots) are the softmax's, before the dropout.
    _, sown = mha.apply(
        {"params": params}, x, train=True, rngs={"dropout": jax.random.key(1)},
        mutable=["intermediates"],
    )  # fmt: skip
    [weights] = sown["intermediates"]["attention_weights"]
    assert np.all(np.asarray(weights) > 0.0)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    without = MultiHeadAttention(config.replace(attention_dropout_rate=0.0))
    np.testing.assert_array_equal(
        mha.apply({"params": params}, x), without.apply({"params": params}, x)
    )


def test_each_public_module_called_without_train_or_decode_is_the_inference_model():
    # A user's own model calls these layers without train= or decode=: that is the model
    # evaluated (no dropout, no dropout RNG asked for) and no decoding cache.
    dropping = _config(dropout_rate=0.3, attention_dropout_rate=0.3)
    plain = dropping.replace(dropout_rate=0.0, attention_dropout_rate=0.0)
    rng = np.random.default_rng(9)
    src, tgt = _batch(rng)
    x = jnp.asarray(rng.normal(size=(*src.shape, plain.d_model)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(*tgt.shape, plain.d_model)), jnp.float32)
    src_mask = padding_mask(src, 0)
    self_mask = causal_mask(tgt.shape[1]) & padding_mask(tgt, 0)  # as the Decoder builds it
    modules_methods_and_inputs = [
        (MultiHeadAttention, None, (y, x, src_mask)),
        (EncoderLayer, None, (x, src_mask)),
        (DecoderLayer, None, (y, x, self_mask, src_mask)),
        (lambda cfg: Encoder(cfg, nn.Embed(VOCAB, cfg.d_model)), None, (src,)),
        (lambda cfg: Decoder(cfg, nn.Embed(VOCAB, cfg.d_model)), None, (x, src, tgt)),
        (Transformer, None, (src, tgt)),
        (Transformer, Transformer.encode, (src,)),
        (Transformer, Transformer.decode, (x, src, tgt)),  # what the searches call
    ]
    for make, method, inputs in modules_methods_and_inputs:
        module = make(dropping)
        name = method.__qualname__ if method else type(module).__name__
        variables = jax.jit(functools.partial(module.init, method=method))(
            jax.random.key(0), *inputs
        )
        assert set(variables) == {"params"}, name  # no "cache" made
        out = jax.jit(functools.partial(module.apply, method=method))(variables, *inputs)
        # No "dropout" RNG was given: a module in training would have asked for one.
        without = jax.jit(functools.partial(make(plain).apply, method=method))(variables, *inputs)
        np.testing.assert_array_equal(out, without, err_msg=name)


def test_bfloat16_compute_keeps_float32_parameters():
    src, tgt = _batch(np.random.default_rng(9))
    model, params = _init(_config(dtype="bfloat16"), src, tgt)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    out = _logits_fn(model)(params, src, tgt)
    assert out.dtype == jnp.float32 and np.isfinite(np.asarray(out)).all()
    reference = _logits_fn(Transformer(_config()))(params, src, tgt)
    np.testing.assert_allclose(out, reference, atol=0.1)


def test_bfloat16_matmuls_keep_float32_activations_and_an_old_config_loads():
    src, tgt = _batch(np.random.default_rng(12))
    model, params = _init(_config(matmul_dtype="bfloat16"), src, tgt)
    out = _logits_fn(model)(params, src, tgt)
    reference = _logits_fn(Transformer(_config()))(params, src, tgt)
    compute = _logits_fn(Transformer(_config(dtype="bfloat16")))(params, src, tgt)
    assert out.dtype == jnp.float32
    # Rounding only the matmul operands stays closer to float32 than bfloat16 compute.
    error = np.abs(np.asarray(out - reference)).max()
    assert 0 < error < np.abs(np.asarray(compute - reference)).max()
    np.testing.assert_allclose(out, reference, atol=0.05)
    old_workdir = {k: v for k, v in _config().to_dict().items() if k != "matmul_dtype"}
    assert TransformerConfig.from_dict(old_workdir).matmul_dtype is None
    with pytest.raises(ValueError, match="matmul_dtype must be one of"):
        _config(matmul_dtype="int8")


def test_shared_embeddings_tie_source_target_and_output():
    src, tgt = _batch(np.random.default_rng(10))
    _, shared = _init(_config(), src, tgt)
    _, separate = _init(_config(share_embeddings=False), src, tgt)
    assert "shared_embedding" in shared and "output_projection" not in shared["decoder"]
    assert {"source_embedding", "target_embedding"} <= set(separate)
    assert "output_projection" in separate["decoder"]


def test_attention_bias_switch_gives_the_papers_projections():
    """The paper's W^Q, W^K, W^V and W^O have no biases; the default's do, as before the switch."""
    src, tgt = _batch(np.random.default_rng(11))
    _, paper = _init(_config(attention_bias=False), src, tgt)
    _, biased = _init(_config(), src, tgt)
    for params, expected in ((paper, set()), (biased, {"bias"})):
        for block in ("self_attention", "cross_attention"):
            attention = params["decoder"]["layer_0"][block]
            for projection in ("query", "key", "value", "out"):
                assert set(attention[projection]) - {"kernel"} == expected, (block, projection)
        assert "bias" in params["decoder"]["layer_0"]["ffn"]["inner"]  # the FFN keeps b1, b2
    old_workdir = {k: v for k, v in _config().to_dict().items() if k != "attention_bias"}
    assert TransformerConfig.from_dict(old_workdir).attention_bias is True


def test_config_round_trip_and_validation():
    config = _config(dropout_rate=0.2)
    assert TransformerConfig.from_dict(config.to_dict()) == config
    assert config.replace(dropout_rate=0.0).dropout_rate == 0.0
    with pytest.raises(ValueError, match="divisible"):
        _config(d_model=30)
    with pytest.raises(ValueError, match="unknown preset"):
        TransformerConfig.preset("huge", vocab_size=10)
    with pytest.raises(ValueError, match="unknown TransformerConfig fields"):
        TransformerConfig.from_dict({**config.to_dict(), "d_modle": 3})
    # The dict is the caller's to change: the frozen config stays as it was.
    fields = config.to_dict()
    fields["d_model"] = 64
    assert config.d_model == 32 and config.to_dict()["d_model"] == 32


def test_an_unknown_preset_is_told_the_names_there_are():
    # train.py --preset prints this line as its usage error.
    with pytest.raises(ValueError) as error:
        TransformerConfig.preset("huge", vocab_size=10)
    assert str(error.value) == "unknown preset 'huge'; choose from base, big, mini, small, tiny"
    assert TransformerConfig.preset_names() == ["base", "big", "mini", "small", "tiny"]
    # Each name builds a preset of its own.
    names = TransformerConfig.preset_names()
    assert len({TransformerConfig.preset(name, vocab_size=VOCAB) for name in names}) == 5


def _parameter_count(config: TransformerConfig) -> int:
    tokens = jnp.ones((1, 4), jnp.int32)
    shapes = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens, tokens)
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))


def test_the_multi30k_presets_are_the_models_of_the_recorded_runs():
    """benchmarks/EXPERIMENTS.md compares `small` (7.07M parameters with the 6000-piece
    vocabulary) with the default `mini` on the same training pairs: both keep the data
    pipeline's longest pair (train.py's --max-len comes from the preset)."""
    import data

    small = TransformerConfig.preset("small", vocab_size=6000)
    assert round(_parameter_count(small) / 1e4) == 707
    for name in ("small", "mini"):
        assert TransformerConfig.preset(name, vocab_size=6000).max_len == data.DEFAULT_MAX_LEN


def test_each_dtype_name_is_that_dtype():
    for name in ("float32", "bfloat16", "float16"):
        config = _config(dtype=name, matmul_dtype=name)
        assert config.compute_dtype == config.matmul_operand_dtype == jnp.dtype(name)
    assert _config().matmul_operand_dtype is None


@pytest.mark.parametrize("beams", [2, 3])
def test_beam_grouped_attention_records_one_weight_row_per_query_sentence(beams):
    # Beam search gives the beams of each of 2 sentences one copy of the source keys and
    # values; the weights it records must still be [batch_q, heads, q_len, kv_len], row i
    # the weights of query i, as with the source repeated per beam (before: [2, H, beams, K]).
    attention = MultiHeadAttention(_config(dropout_rate=0.0))
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(2 * beams, 1, 32)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(2, 3, 32)), jnp.float32)
    params = attention.init(jax.random.key(0), q, jnp.repeat(kv, beams, axis=0))["params"]

    def weights(kv_batch):
        out, state = attention.apply({"params": params}, q, kv_batch, mutable=["intermediates"])
        return out, state["intermediates"]["attention_weights"][0]

    out_grouped, grouped = weights(kv)
    out_repeated, repeated = weights(jnp.repeat(kv, beams, axis=0))
    assert grouped.shape == repeated.shape == (2 * beams, 4, 1, 3)
    np.testing.assert_allclose(grouped, repeated, atol=1e-6)
    np.testing.assert_allclose(out_grouped, out_repeated, atol=1e-5)


@pytest.mark.parametrize("pad_id", [40, -1])
def test_a_pad_id_outside_the_vocabulary_is_a_config_error(pad_id):
    # 40 of 40 embedded as NaN and made every logit NaN; -1 took the last row.
    with pytest.raises(ValueError, match="pad_id must be in"):
        _config(pad_id=pad_id)


def test_sizes_below_one_are_config_errors_and_one_is_a_size():
    # A 0-layer stack or 0-wide model would build and train to nothing.
    for field in ("d_model", "num_heads", "d_ff", "num_encoder_layers", "max_len"):
        with pytest.raises(ValueError, match=f"^{field} must be >= 1, got 0$"):
            TransformerConfig.preset("tiny", **{"vocab_size": VOCAB, field: 0})
    one = dict(num_heads=1, num_encoder_layers=1, num_decoder_layers=1, d_ff=1, max_len=1)
    config = TransformerConfig.preset("tiny", vocab_size=VOCAB, **one)
    assert (config.num_heads, config.d_head, config.num_encoder_layers) == (1, 32, 1)


@pytest.mark.parametrize("field", ["dropout_rate", "attention_dropout_rate"])
def test_a_dropout_rate_that_drops_everything_is_a_config_error(field):
    with pytest.raises(ValueError, match=rf"^{field} must be in \[0, 1\)"):
        TransformerConfig.preset("tiny", **{"vocab_size": VOCAB, field: 1.0})


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("vocab_size", "8000", "vocab_size must be an integer, got '8000'"),
        ("d_model", 32.0, "d_model must be an integer, got 32.0"),
        ("num_heads", True, "num_heads must be an integer, got True"),
        ("share_embeddings", "no", "share_embeddings must be True or False, got 'no'"),
        ("share_embeddings", 1, "share_embeddings must be True or False, got 1"),
        ("dropout_rate", "0.1", "dropout_rate must be a number, got '0.1'"),
        ("dropout_rate", False, "dropout_rate must be a number, got False"),
        ("pad_id", 0.0, "pad_id must be an integer, got 0.0"),
        (
            "dtype",
            "float64",
            "dtype must be one of ['bfloat16', 'float16', 'float32'], got 'float64'",
        ),
        ("dtype", None, "dtype must be one of ['bfloat16', 'float16', 'float32'], got None"),
    ],
)
def test_a_field_of_the_wrong_type_is_a_config_error_naming_it(field, value, message):
    # Before: a float width built and failed in init on its shapes, "no" meant True.
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        TransformerConfig.preset("tiny", **{"vocab_size": VOCAB, field: value})
    numpy_scalars = dict(
        vocab_size=np.int64(VOCAB),
        pre_layer_norm=np.bool_(True),
        dropout_rate=np.float64(0.25),
        attention_dropout_rate=np.float32(0.125),  # not a subclass of float, as float64 is
        pad_id=np.int32(1),
    )
    config = TransformerConfig.preset("tiny", **numpy_scalars)
    assert config.vocab_size == VOCAB and config.pre_layer_norm and config.dropout_rate == 0.25
    assert config.attention_dropout_rate == 0.125 and config.pad_id == 1
    # Taken as Python's numbers, so the config json.dumps can write (train.py's config.json).
    assert TransformerConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_source_and_target_of_different_batches_are_an_error_naming_both():
    rng = np.random.default_rng(0)
    src, tgt = _batch(rng)
    model, params = _init(_config(), src, tgt)
    with pytest.raises(ValueError, match="same batch, got 3 and 1"):
        model.apply({"params": params}, src, tgt[:1])
    # A whole multiple too: each source was paired with 2 targets, silently.
    with pytest.raises(ValueError, match="same batch, got 3 and 6"):
        model.apply({"params": params}, src, jnp.concatenate([tgt, tgt]))
    # decode() takes r rows per sentence (beam search), and only whole multiples.
    encoded = model.apply({"params": params}, src, method=Transformer.encode)
    with pytest.raises(ValueError, match=r"queries' batch \(1\) is not a multiple of .* \(3\)"):
        model.apply({"params": params}, encoded, src, tgt[:1], method=Transformer.decode)
    # Queries against no source sentence are the same error, not a division by zero.
    with pytest.raises(ValueError, match=r"queries' batch \(3\) is not a multiple of .* \(0\)"):
        model.apply({"params": params}, encoded[:0], src[:0], tgt, method=Transformer.decode)


def test_an_empty_batch_gives_empty_logits():
    # It was a ZeroDivisionError, in training code and the searches alike.
    src, tgt = _batch(np.random.default_rng(0))
    model, params = _init(_config(), src, tgt)
    logits = model.apply({"params": params}, src[:0], tgt[:0])
    assert logits.shape == (0, tgt.shape[1], VOCAB)


def test_float16_attention_scores_above_its_range_before_scaling_are_not_nan():
    # Q K^T was rounded to float16 before the division by sqrt(d_k): a product past 65504
    # was inf, and the softmax made NaN of it, though the scaled score (12800) fits.
    q = jnp.full((1, 1, 1, 64), 40.0, jnp.float16)
    k = jnp.stack([jnp.full((64,), 40.0), jnp.full((64,), 39.0)])[None, :, None, :]
    v = jnp.eye(2, dtype=jnp.float16)[None, :, None, :]
    out, weights = scaled_dot_product_attention(q, k.astype(jnp.float16), v)
    np.testing.assert_array_equal(np.asarray(weights[0, 0, 0]), [1.0, 0.0])
    np.testing.assert_array_equal(np.asarray(out[0, 0, 0], np.float32), [1.0, 0.0])


def test_reverse_mode_autodiff_works_and_forward_mode_is_refused_as_the_readme_says():
    rng = np.random.default_rng(0)
    src, tgt = _batch(rng)
    model, params = _init(_config(), src, tgt)

    def total(p):
        return model.apply({"params": p}, src, tgt).sum()

    grads = jax.jit(jax.grad(total))(params)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    with pytest.raises(
        TypeError, match=r"can't apply forward-mode autodiff \(jvp\) to a custom_vjp"
    ):
        jax.jvp(total, (params,), (params,))


def test_attention_scales_by_the_key_width_and_takes_values_of_another_width():
    # d_v need not be d_k (the docstring's shapes): the scores are divided by sqrt(d_k), the
    # queries' and keys' width, and the output has the values' width.
    rng = np.random.default_rng(13)
    q, k = (jnp.asarray(rng.normal(size=(2, 3, 2, 8)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(2, 3, 2, 2)), jnp.float32)
    out, weights = jax.jit(scaled_dot_product_attention)(q, k, v)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8.0)
    expected = np.exp(scores - scores.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(weights, expected, atol=1e-6)
    assert out.shape == (2, 3, 2, 2)
    np.testing.assert_allclose(out, np.einsum("bhqk,bkhd->bqhd", expected, v), atol=1e-5)


def test_float16_attention_gives_the_float32_weights_and_the_values_dtype():
    # The float16 path scales the queries before the product: by sqrt(d_k), as in float32
    # (the other float16 test's scores are so far apart that any scale gave [1, 0]).
    rng = np.random.default_rng(14)
    q, k, v = (rng.normal(size=(1, 4, 2, 16)).astype(np.float32) for _ in range(3))
    out32, weights32 = scaled_dot_product_attention(*map(jnp.asarray, (q, k, v)))
    half = [jnp.asarray(x, jnp.float16) for x in (q, k, v)]
    out16, weights16 = scaled_dot_product_attention(*half)
    assert weights16.dtype == jnp.float32 and out16.dtype == jnp.float16
    np.testing.assert_allclose(weights16, weights32, atol=2e-3)
    np.testing.assert_allclose(np.asarray(out16, np.float32), out32, atol=1e-2)
    # bfloat16 inputs give bfloat16 outputs (the float32 weights are cast to the values').
    out_bf16, _ = scaled_dot_product_attention(*(x.astype(jnp.bfloat16) for x in half))
    assert out_bf16.dtype == jnp.bfloat16


def test_attention_with_matmul_dtype_multiplies_the_rounded_operands():
    # matmul_dtype rounds the operands of both products, Q K^T and weights V, and
    # accumulates in float32.
    rng = np.random.default_rng(15)
    q, k, v = (rng.normal(size=(2, 5, 2, 8)).astype(np.float32) for _ in range(3))

    def rounded(x):
        return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)

    out, weights = jax.jit(
        functools.partial(scaled_dot_product_attention, matmul_dtype=jnp.bfloat16)
    )(q, k, v)
    scores = np.einsum("bqhd,bkhd->bhqk", rounded(q), rounded(k)) / np.sqrt(8.0)
    expected = np.exp(scores - scores.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(weights, expected, atol=1e-6)
    expected_out = np.einsum("bhqk,bkhd->bqhd", rounded(np.asarray(weights)), rounded(v))
    np.testing.assert_allclose(out, expected_out, atol=1e-5)
    assert not np.allclose(out, np.einsum("bhqk,bkhd->bqhd", np.asarray(weights), v), atol=1e-5)


def test_cached_steps_read_the_cross_attention_keys_init_cache_projected():
    # The source keys and values are projected once, by init_cache; a step reads them
    # from the cache, not from the encoder output it is given again.
    src, tgt = _batch(np.random.default_rng(16))
    model, params = _init(_config(), src, tgt)
    variables = {"params": params}
    encoded = model.apply(variables, src, method=Transformer.encode)
    _, state = model.apply(
        variables, encoded, src, 3, method=Transformer.init_cache, mutable=["cache"]
    )

    def step(encoding):
        logits, _ = model.apply(
            {**variables, "cache": state["cache"]}, encoding, src, tgt[:, :1],
            decode=True, method=Transformer.decode, mutable=["cache"],
        )  # fmt: skip
        return logits

    np.testing.assert_array_equal(step(jnp.zeros_like(encoded)), step(encoded))
    full = model.apply(variables, encoded, src, tgt, method=Transformer.decode)
    np.testing.assert_allclose(step(encoded)[:, 0], full[:, 0], atol=1e-5)


def test_training_without_attention_dropout_needs_no_dropout_rng():
    # As the Dropout module: a rate of 0 asks for no "dropout" RNG, so train=True runs
    # without one and is the inference output.
    config = _config(dropout_rate=0.0, attention_dropout_rate=0.0)
    x = jnp.asarray(np.random.default_rng(17).normal(size=(2, 4, config.d_model)), jnp.float32)
    attention = MultiHeadAttention(config)
    variables = attention.init(jax.random.key(0), x)
    np.testing.assert_array_equal(
        attention.apply(variables, x, train=True), attention.apply(variables, x)
    )


def test_attention_projections_run_in_the_compute_dtype():
    config = _config(dtype="bfloat16")
    x = jnp.asarray(np.random.default_rng(18).normal(size=(2, 4, config.d_model)), jnp.float32)
    attention = MultiHeadAttention(config)
    variables = attention.init(jax.random.key(0), x)
    out, state = attention.apply(
        variables, x, capture_intermediates=True, mutable=["intermediates"]
    )
    assert out.dtype == jnp.bfloat16
    for projection in ("query", "key", "value", "out"):
        (y,) = state["intermediates"][projection]["__call__"]
        assert y.dtype == jnp.bfloat16, projection


def test_kernels_start_glorot_uniform_and_embeddings_at_unit_variance_after_scaling():
    # Every projection kernel is drawn from Glorot's uniform range +-sqrt(6 / (fan_in +
    # fan_out)) (the heads' axes counted in their fan); the embeddings have standard deviation
    # d_model^-0.5, unit variance once multiplied by sqrt(d_model).
    config = _config(share_embeddings=False)
    src, tgt = _batch(np.random.default_rng(19))
    _, params = _init(config, src, tgt)
    layer = params["decoder"]["layer_0"]
    d, f = config.d_model, config.d_ff
    kernels = {
        "query": (layer["cross_attention"]["query"]["kernel"], d, d),
        "out": (layer["self_attention"]["out"]["kernel"], d, d),
        "inner": (layer["ffn"]["inner"]["kernel"], d, f),
        "outer": (layer["ffn"]["outer"]["kernel"], f, d),
        "output_projection": (params["decoder"]["output_projection"]["kernel"], d, VOCAB),
    }
    for name, (kernel, fan_in, fan_out) in kernels.items():
        bound = np.sqrt(6.0 / (fan_in + fan_out))
        largest = np.abs(np.asarray(kernel)).max()
        assert 0.9 * bound < largest <= bound, (name, largest, bound)
    for name in ("source_embedding", "target_embedding"):
        std = np.asarray(params[name]["embedding"]).std()
        assert 0.9 < std * np.sqrt(d) < 1.1, (name, std)


def test_arrays_of_too_many_axes_are_errors_that_name_the_argument():
    x = jnp.ones((2, 5, 1, 8))
    with pytest.raises(ValueError, match=r"q_BQHD must have 4 axes .* got shape \(1, 2, 5, 1, 8\)"):
        scaled_dot_product_attention(x[None], x, x)
    with pytest.raises(ValueError, match=r"mask must have 4 axes .* got shape \(2, 1, 5\)"):
        scaled_dot_product_attention(x, x, x, jnp.ones((2, 1, 5), bool))
    layer = MultiHeadAttention(_config())
    params = layer.init(jax.random.key(0), jnp.ones((1, 5, 32)))
    with pytest.raises(ValueError, match=r"inputs_q_BQD must have 3 axes .* \(1, 5, 1, 32\)"):
        layer.apply(params, jnp.ones((1, 5, 1, 32)))


def test_positional_encoding_of_an_odd_width_has_that_width():
    pe = sinusoidal_positional_encoding(3, 5)
    assert pe.shape == (3, 5)
    np.testing.assert_allclose(pe[:, 4], np.sin(np.arange(3) / 10000 ** (4 / 5)), atol=1e-6)


def test_a_padding_id_other_than_0_is_the_padding_and_ids_below_it_are_words():
    assert padding_mask(jnp.array([[1, 3, 2, 3]]), 3)[0, 0, 0].tolist() == [
        True, False, True, False,
    ]  # fmt: skip
    pad = 3
    config = _config(pad_id=pad)
    src = jnp.asarray([[1, 2, 5, 7, pad], [4, 1, 2, pad, pad]], jnp.int32)
    tgt = jnp.asarray([[1, 6, 2, 9], [1, 2, 8, pad]], jnp.int32)
    model, params = _init(config, src, tgt)
    logits = _logits_fn(model)
    base = logits(params, src, tgt)
    more_padding = logits(
        params,
        jnp.pad(src, ((0, 0), (0, 3)), constant_values=pad),
        jnp.pad(tgt, ((0, 0), (0, 2)), constant_values=pad),
    )
    real = np.asarray(tgt != pad)
    np.testing.assert_allclose(
        np.asarray(more_padding[:, :4])[real], np.asarray(base)[real], atol=1e-5
    )


def test_the_feed_forward_network_is_the_papers_relu_network():
    from transformer.model import FeedForward

    config = _config()
    x = jnp.asarray(np.random.default_rng(20).normal(size=(2, 3, config.d_model)), jnp.float32)
    ffn = FeedForward(config)
    variables = ffn.init(jax.random.key(0), x)
    p = jax.tree.map(np.asarray, variables["params"])
    hidden = np.maximum(0.0, np.asarray(x) @ p["inner"]["kernel"] + p["inner"]["bias"])
    expected = hidden @ p["outer"]["kernel"] + p["outer"]["bias"]
    np.testing.assert_allclose(ffn.apply(variables, x), expected, atol=1e-5)


def test_the_layer_norm_adds_1e_6_to_the_variance():
    # Visible on activations of small variance, where epsilon is not negligible.
    from transformer.model import _SublayerConnection

    config = _config()
    x = np.random.default_rng(21).normal(0.0, 1e-3, (1, 2, config.d_model)).astype(np.float32)
    block = _SublayerConnection(config)
    params = block.init(jax.random.key(0), x, jnp.zeros_like, False)
    out = np.asarray(block.apply(params, x, jnp.zeros_like, False))
    expected = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(out, expected, rtol=1e-3, atol=1e-4)


def test_both_stacks_embed_from_position_0_with_their_own_table():
    # The source is embedded with source_embedding and the target with target_embedding,
    # each at positions 0, 1, ... (section 3.5), whatever the other stack does.
    config = _config(share_embeddings=False)
    src, tgt = _batch(np.random.default_rng(22))
    model, params = _init(config, src, tgt)
    _, state = model.apply(
        {"params": params}, src, tgt, capture_intermediates=True, mutable=["intermediates"]
    )
    for stack, tokens, table in (
        ("encoder", src, "source_embedding"),
        ("decoder", tgt, "target_embedding"),
    ):
        (embedded,) = state["intermediates"][stack]["embedding"]["__call__"]
        rows = np.asarray(params[table]["embedding"])[np.asarray(tokens)]
        pe = sinusoidal_positional_encoding(tokens.shape[1], config.d_model)
        expected = rows * np.sqrt(config.d_model) + np.asarray(pe)[None]
        np.testing.assert_allclose(embedded, expected, atol=1e-5, err_msg=stack)


def test_each_stack_has_its_own_number_of_layers():
    config = _config(num_encoder_layers=1, num_decoder_layers=3)
    tokens = jnp.ones((1, 4), jnp.int32)
    shapes = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens, tokens)
    layers = {
        stack: sorted(k for k in shapes["params"][stack] if k.startswith("layer_"))
        for stack in ("encoder", "decoder")
    }
    assert layers == {"encoder": ["layer_0"], "decoder": ["layer_0", "layer_1", "layer_2"]}


def test_attention_with_bfloat16_matmuls_rounds_its_own_products_too():
    # matmul_dtype reaches the two attention products, not only the projections: the
    # weights sown are those of the rounded projections' scores.
    config = _config(matmul_dtype="bfloat16")
    x = jnp.asarray(np.random.default_rng(23).normal(size=(2, 5, config.d_model)), jnp.float32)
    attention = MultiHeadAttention(config)
    variables = attention.init(jax.random.key(0), x)
    _, state = attention.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
    q, k, v = (state["intermediates"][name]["__call__"][0] for name in ("query", "key", "value"))
    (sown,) = state["intermediates"]["attention_weights"]
    _, rounded = scaled_dot_product_attention(q, k, v, matmul_dtype=jnp.bfloat16)
    _, exact = scaled_dot_product_attention(q, k, v)
    np.testing.assert_allclose(sown, rounded, atol=1e-6)
    assert not np.allclose(sown, exact, atol=1e-6)


def test_training_drops_out_both_stacks_embeddings():
    # Section 5.4: dropout on the sums of embeddings and positional encodings, in the encoder
    # and the decoder stack alike, when the Transformer is called with train=True.
    config = _config(dropout_rate=0.5)
    src, tgt = _batch(np.random.default_rng(24))
    model, params = _init(config, src, tgt)
    _, state = model.apply(
        {"params": params}, src, tgt, train=True, rngs={"dropout": jax.random.key(1)},
        capture_intermediates=True, mutable=["intermediates"],
    )  # fmt: skip
    for stack in ("encoder", "decoder"):
        (embedded,) = state["intermediates"][stack]["embedding"]["__call__"]
        assert 0.3 < np.mean(np.asarray(embedded) == 0) < 0.7, stack


def test_bfloat16_matmuls_round_the_shared_output_projection_too():
    # The logits are the last layer's output times the embedding table, both rounded to
    # matmul_dtype (post-LN: no final norm in between).
    config = _config(matmul_dtype="bfloat16")
    src, tgt = _batch(np.random.default_rng(25))
    model, params = _init(config, src, tgt)
    logits, state = model.apply(
        {"params": params}, src, tgt, capture_intermediates=True, mutable=["intermediates"]
    )
    (last,) = state["intermediates"]["decoder"][f"layer_{config.num_decoder_layers - 1}"][
        "__call__"
    ]

    def rounded(x):
        return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)

    table = params["shared_embedding"]["embedding"]
    np.testing.assert_allclose(logits, rounded(last) @ rounded(table).T, rtol=1e-5, atol=1e-5)
    assert not np.allclose(logits, np.asarray(last) @ np.asarray(table).T, rtol=1e-5, atol=1e-5)
