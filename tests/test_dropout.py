"""The byte-threshold dropout: its rate, its scaling, and its determinism per key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.dropout import Dropout, dropout, quantized_rate


def test_drops_the_quantized_rate_and_keeps_the_expectation():
    x = jnp.ones((1000, 1000), jnp.float32)
    y = np.asarray(dropout(x, 0.1, jax.random.key(0)))
    assert quantized_rate(0.1) == 26 / 256
    # 1e6 Bernoulli draws: the standard error of the fraction is 3e-4.
    assert abs(np.mean(y == 0.0) - 26 / 256) < 2e-3
    np.testing.assert_allclose(np.unique(y), [0.0, 256 / 230], rtol=1e-6)
    assert abs(y.mean() - 1.0) < 3e-3
    # The smallest rate that is not 0, one level: dropped too, not taken for none.
    y = np.asarray(dropout(x, 1 / 256, jax.random.key(5)))
    assert abs(np.mean(y == 0.0) - 1 / 256) < 5e-4  # standard error 6e-5


def test_elements_are_dropped_independently():
    # One 32-bit draw serves four elements, a byte each: neighbours, in a row and across
    # rows, must still be dropped together only as often as chance says.
    dropped = np.asarray(dropout(jnp.ones((1000, 1000)), 0.1, jax.random.key(4))) == 0.0
    for a, b in ((dropped[:, :-1], dropped[:, 1:]), (dropped[:-1], dropped[1:])):
        assert abs(np.mean(a & b) - (26 / 256) ** 2) < 1e-3  # 1e6 pairs: error about 1e-4


def test_odd_sizes_and_dtypes_keep_their_shape_and_dtype():
    x = jnp.ones((3, 5, 7), jnp.bfloat16)
    y = dropout(x, 0.5, jax.random.key(1))
    assert y.shape == x.shape and y.dtype == jnp.bfloat16
    assert 0 < int(jnp.sum(y == 0)) < x.size
    # "Any array": an integer one too stays integer (its dropped elements an integer 0).
    y = dropout(jnp.ones((3, 5, 7), jnp.int32), 0.5, jax.random.key(1))
    assert y.shape == x.shape and y.dtype == jnp.int32
    assert 0 < int(jnp.sum(y == 0)) < x.size


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_inputs_keep_their_expectation(dtype):
    # The scale 256/230 rounded to bfloat16 is 1.109375: 0.33% low on every kept value.
    x = jax.random.uniform(jax.random.key(2), (4_000_000,), jnp.float32, 1.0, 2.0).astype(dtype)
    y = dropout(x, 0.1, jax.random.key(3))
    assert y.dtype == dtype
    ratio = float(jnp.sum(y.astype(jnp.float32)) / jnp.sum(x.astype(jnp.float32)))
    # 4e6 draws: the dropout's own standard error of this ratio is about 2e-4.
    assert abs(ratio - 1.0) < 1e-3


def test_masks_follow_the_key():
    x = jnp.ones((64, 128))
    a = dropout(x, 0.1, jax.random.key(0))
    np.testing.assert_array_equal(a, dropout(x, 0.1, jax.random.key(0)))
    assert not np.array_equal(a, dropout(x, 0.1, jax.random.key(1)))


def test_module_is_identity_when_deterministic_or_rate_rounds_to_zero():
    x = jnp.arange(1.0, 13.0).reshape(3, 4)  # no zeros of its own: a zero out is dropped
    rngs = {"dropout": jax.random.key(0)}
    assert Dropout(0.5, deterministic=True).apply({}, x, rngs=rngs) is x
    # Flax's call form too: a drop-in for nn.Dropout(rate)(x, deterministic=not train).
    assert Dropout(0.5).apply({}, x, deterministic=True) is x
    assert np.any(np.asarray(Dropout(0.5).apply({}, x, deterministic=False, rngs=rngs)) == 0.0)
    with pytest.raises(ValueError, match="deterministic"):  # both: ambiguous, as in Flax
        Dropout(0.5, deterministic=False).apply({}, x, deterministic=True, rngs=rngs)
    assert Dropout(0.001).apply({}, x, rngs=rngs) is x  # 0.256 of a level rounds to 0
    assert Dropout(0.001).apply({}, x) is x  # and takes no random key
    assert np.any(np.asarray(Dropout(0.5).apply({}, x, rngs=rngs)) == 0.0)


def test_module_drops_at_its_own_rate():
    x = jnp.ones((100_000,))
    rngs = {"dropout": jax.random.key(6)}
    for rate in (0.1, 0.7):
        y = np.asarray(Dropout(rate, deterministic=False).apply({}, x, rngs=rngs))
        # 1e5 draws: the standard error of the fraction is at most 1.6e-3.
        assert abs(np.mean(y == 0.0) - quantized_rate(rate)) < 8e-3, rate
        np.testing.assert_allclose(y[y != 0], 1 / (1 - quantized_rate(rate)), rtol=1e-6)


def test_rejects_a_rate_outside_0_1_or_rounding_to_1():
    # 0.999 rounds to 256/256: every element dropped; NaN and infinity named as the others.
    for rate in (1.0, -0.1, 0.999, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=rf"dropout rate must be in \[0, 1\).*got {rate}"):
            dropout(jnp.ones(4), rate, jax.random.key(0))
    kept = dropout(jnp.ones(4096), 0.997, jax.random.key(0))  # 255/256: the largest rate
    assert np.isfinite(kept).all() and 0 < np.count_nonzero(kept) < 64
    # The edge the message names: 255.5/256 rounds (to even) to 256/256, just below it to 255.
    dropout(jnp.ones(4), np.nextafter(255.5 / 256, 0), jax.random.key(0))
    with pytest.raises(ValueError, match=r"below 255\.5/256 \(about 0\.99805\)"):
        dropout(jnp.ones(4), 255.5 / 256, jax.random.key(0))
