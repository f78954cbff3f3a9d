"""Dropout with one random byte per element: one 32-bit random draw serves four elements.

`flax.linen.Dropout` draws a 32-bit threefry word per element (jax.random.bernoulli),
and on a CPU that hashing is the largest single cost of the training step after
the matmuls: drawing the 2.9M elements of the `mini` preset's 22 dropout masks at
64 x 16 tokens took 38 ms with jax.random.bits (any dtype) on this project's 2-core
machine, and 4 ms as a quarter as many 32-bit words cut into bytes. So the keep decision here
compares one random byte with a threshold. The price is that the rate is
rounded to a multiple of 1/256 (0.1 becomes 26/256 = 0.1016); the kept values
are scaled by 1 / (1 - that rounded rate), so the expectation is kept (the product is
taken in float32 for bfloat16 and float16 inputs, so the scale is not rounded to them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

_LEVELS = 256  # one byte per element


def _threshold(rate: float) -> int:
    """Bytes below this are dropped: `rate` in units of 1/256, rounded."""
    return round(rate * _LEVELS)


def quantized_rate(rate: float) -> float:
    """The dropout rate actually applied: `rate` rounded to a multiple of 1/256."""
    return _threshold(rate) / _LEVELS


def check_rate(rate: float, name: str = "dropout rate") -> None:
    """Raises ValueError unless `rate` is in [0, 1) and does not round to 1 (255.5/256, about
    0.99805, and above)."""
    if not 0.0 <= rate < 1.0 or quantized_rate(rate) >= 1.0:
        raise ValueError(
            f"{name} must be in [0, 1) and below 255.5/256 (about 0.99805), which the 1/256 "
            f"steps of dropout round to 1; got {rate}"
        )


def dropout(x: jax.Array, rate: float, rng: jax.Array) -> jax.Array:
    """Zeroes each element of `x` with probability `quantized_rate(rate)`, scales the rest.

    Args:
      x: any array.
      rate: drop probability in [0, 1), below 255.5/256 (see `check_rate`).
      rng: a PRNG key.

    Returns:
      An array like `x`.
    """
    check_rate(rate)
    threshold = _threshold(rate)
    if threshold == 0:
        return x
    words = jax.random.bits(rng, (-(-x.size // 4),), jnp.uint32)
    bytes_ = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)[: x.size]
    keep = bytes_.reshape(x.shape) >= threshold
    # Scaled in at least float32: a scale rounded to bfloat16 (1.109375 for 256 / 230 =
    # 1.1130) would shrink every kept value by 0.3%; rounding each product is unbiased.
    wide = jnp.promote_types(x.dtype, jnp.float32)
    scaled = (x.astype(wide) * jnp.asarray(_LEVELS / (_LEVELS - threshold), wide)).astype(x.dtype)
    return jnp.where(keep, scaled, jnp.zeros((), x.dtype))


class Dropout(nn.Module):
    """`flax.linen.Dropout`'s interface (rate, deterministic; the "dropout" RNG) over `dropout`.

    `deterministic` is given as an attribute or in the call, as for Flax's (not both);
    given in neither, the input is dropped (where Flax's raises).

    Attributes:
      rate: drop probability (rounded to a multiple of 1/256).
      deterministic: True passes the input through unchanged.
    """

    rate: float
    deterministic: bool | None = None

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool | None = None) -> jax.Array:
        if self.deterministic is not None or deterministic is not None:
            deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if deterministic or quantized_rate(self.rate) == 0.0:
            return x
        return dropout(x, self.rate, self.make_rng("dropout"))
