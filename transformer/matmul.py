"""Matrix products whose gradients XLA:CPU can hand to its fast matmul library.

XLA:CPU runs a dot as a YNNPACK kernel only if the left operand's contracted
dimension is its last one; any other dot falls back to a slower Eigen kernel.
Autodiff of `x @ w` computes the weight gradient as `x^T @ g`, which contracts
the left operand over its first dimension, and XLA folds an explicit transpose
written in front of it back into the dot. The public functions here compute the
same values as their plain forms, but their backward pass transposes that
operand into a copy that XLA cannot fold away (`jax.lax.optimization_barrier`),
so every gradient matmul runs as a YNNPACK kernel. The gradients are the plain
ones up to float rounding. On other backends the copies neither clearly help nor
hurt: on an H100 the step with them took 11.0 ms against 13.2 ms with plain
gradients for `mini` and 51.1 against 48.2 ms for `base` (one run each;
benchmarks/EXPERIMENTS.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax


def _materialized_transpose(x: jax.Array, axes: Sequence[int]) -> jax.Array:
    """`jnp.transpose(x, axes)` as a real copy, which XLA will not fold into a consumer dot."""
    return lax.optimization_barrier(jnp.transpose(x, axes))


def _product_transposed(a_MN: jax.Array, b_NK: jax.Array) -> jax.Array:
    """(a @ b)^T [K, M], the product kept whole before the transpose.

    Without the barrier on the product, XLA rewrites transpose(a @ b) as a dot
    contracting b over its first dimension: the slow kind again.
    """
    return _materialized_transpose(lax.optimization_barrier(a_MN @ b_NK), (1, 0))


def dense_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: lax.DotDimensionNumbers,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
) -> jax.Array:
    """`lax.dot_general` for a dense layer, with YNNPACK-friendly gradients.

    Takes the arguments of `lax.dot_general`, so it can be given to
    `flax.linen.Dense(dot_general=...)` and `DenseGeneral`. When `lhs`'s last n
    dimensions are contracted with `rhs`'s first n, in order, and there are no
    batch dimensions (every dense layer of this model), the product and both
    gradients are computed as one 2-D matmul each: [N, K] x [K, M] forward,
    g [N, M] x w^T for the input gradient, and x^T [K, N] x g [N, M] (or
    (g^T [M, N] x x [N, K])^T when M < K, to transpose the smaller array) for
    the weight gradient. Any other dimension numbers, or an explicit
    `precision`, go to `lax.dot_general` unchanged.
    """
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    n = len(lhs_contract)
    dense = (
        not lhs_batch
        and not rhs_batch
        and tuple(lhs_contract) == tuple(range(lhs.ndim - n, lhs.ndim))
        and tuple(rhs_contract) == tuple(range(n))
    )
    if not dense or precision is not None:
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    k = math.prod(rhs.shape[:n])
    out_shape = lhs.shape[: lhs.ndim - n] + rhs.shape[n:]
    x_NK = lhs.reshape(-1, k)
    w_KM = rhs.reshape(k, -1)
    if preferred_element_type is not None:
        x_NK = x_NK.astype(preferred_element_type)
        w_KM = w_KM.astype(preferred_element_type)
    return _matmul(x_NK, w_KM).reshape(out_shape)


@jax.custom_vjp
def _matmul(x_NK: jax.Array, w_KM: jax.Array) -> jax.Array:
    return x_NK @ w_KM


def _matmul_fwd(x_NK: jax.Array, w_KM: jax.Array):
    return x_NK @ w_KM, (x_NK, w_KM)


def _matmul_bwd(residuals, g_NM: jax.Array):
    x_NK, w_KM = residuals
    dx_NK = lax.dot_general(g_NM, w_KM, (((1,), (1,)), ((), ())))
    if w_KM.shape[0] <= w_KM.shape[1]:
        dw_KM = _materialized_transpose(x_NK, (1, 0)) @ g_NM
    else:
        dw_KM = _product_transposed(_materialized_transpose(g_NM, (1, 0)), x_NK)
    return dx_NK.astype(x_NK.dtype), dw_KM.astype(w_KM.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul_transposed(x: jax.Array, w_MK: jax.Array) -> jax.Array:
    """x [..., K] @ w^T for w [M, K] (a tied output projection), with YNNPACK-friendly gradients.

    The gradient of w is computed as (x^T g)^T: x [N, K] is the operand
    transposed, not the logit gradient g [N, M], which is far larger when M is
    the vocabulary.

    Args:
      x: [..., K].
      w_MK: [M, K], e.g. an embedding table [vocab, d_model].

    Returns:
      [..., M].
    """
    k = w_MK.shape[1]
    return _matmul_nt(x.reshape(-1, k), w_MK).reshape(*x.shape[:-1], w_MK.shape[0])


@jax.custom_vjp
def _matmul_nt(x_NK: jax.Array, w_MK: jax.Array) -> jax.Array:
    return lax.dot_general(x_NK, w_MK, (((1,), (1,)), ((), ())))


def _matmul_nt_fwd(x_NK: jax.Array, w_MK: jax.Array):
    return _matmul_nt(x_NK, w_MK), (x_NK, w_MK)


def _matmul_nt_bwd(residuals, g_NM: jax.Array):
    x_NK, w_MK = residuals
    dx_NK = g_NM @ w_MK
    dw_MK = _product_transposed(_materialized_transpose(x_NK, (1, 0)), g_NM)
    return dx_NK.astype(x_NK.dtype), dw_MK.astype(w_MK.dtype)


_matmul_nt.defvjp(_matmul_nt_fwd, _matmul_nt_bwd)


def _scores(q_BQHD: jax.Array, k_BKHD: jax.Array) -> jax.Array:
    return jnp.einsum("bqhd,bkhd->bhqk", q_BQHD, k_BKHD)


def _weighted_sum(weights_BHQK: jax.Array, v_BKHD: jax.Array) -> jax.Array:
    return jnp.einsum("bhqk,bkhd->bqhd", weights_BHQK, v_BKHD)


def _swap_last_two(x_BHXY: jax.Array) -> jax.Array:
    """[batch, heads, x, y] -> [batch, heads, y, x] as a real copy (see the module docstring)."""
    return _materialized_transpose(x_BHXY, (0, 1, 3, 2))


# Each product's gradients are the two products again: the one contracting the
# last dimension of a [batch, heads, ., .] operand is given it transposed.


@jax.custom_vjp
def attention_scores(q_BQHD: jax.Array, k_BKHD: jax.Array) -> jax.Array:
    """Q K^T per head: `einsum("bqhd,bkhd->bhqk")`, with YNNPACK-friendly gradients.

    Args:
      q_BQHD: queries [batch, q_len, heads, d_k].
      k_BKHD: keys [batch, kv_len, heads, d_k].

    Returns:
      [batch, heads, q_len, kv_len].
    """
    return _scores(q_BQHD, k_BKHD)


def _attention_scores_fwd(q_BQHD: jax.Array, k_BKHD: jax.Array):
    return attention_scores(q_BQHD, k_BKHD), (q_BQHD, k_BKHD)


def _attention_scores_bwd(residuals, g_BHQK: jax.Array):
    q_BQHD, k_BKHD = residuals
    dq_BQHD = _weighted_sum(g_BHQK, k_BKHD)
    dk_BKHD = _weighted_sum(_swap_last_two(g_BHQK), q_BQHD)
    return dq_BQHD.astype(q_BQHD.dtype), dk_BKHD.astype(k_BKHD.dtype)


attention_scores.defvjp(_attention_scores_fwd, _attention_scores_bwd)


@jax.custom_vjp
def attend(weights_BHQK: jax.Array, v_BKHD: jax.Array) -> jax.Array:
    """Values weighted per head, `einsum("bhqk,bkhd->bqhd")`, with YNNPACK-friendly gradients.

    Args:
      weights_BHQK: attention weights [batch, heads, q_len, kv_len].
      v_BKHD: values [batch, kv_len, heads, d_v].

    Returns:
      [batch, q_len, heads, d_v].
    """
    return _weighted_sum(weights_BHQK, v_BKHD)


def _attend_fwd(weights_BHQK: jax.Array, v_BKHD: jax.Array):
    return attend(weights_BHQK, v_BKHD), (weights_BHQK, v_BKHD)


def _attend_bwd(residuals, g_BQHD: jax.Array):
    weights_BHQK, v_BKHD = residuals
    dweights_BHQK = _scores(g_BQHD, v_BKHD)
    dv_BKHD = _weighted_sum(_swap_last_two(weights_BHQK), g_BQHD)
    return dweights_BHQK.astype(weights_BHQK.dtype), dv_BKHD.astype(v_BKHD.dtype)


attend.defvjp(_attend_fwd, _attend_bwd)
