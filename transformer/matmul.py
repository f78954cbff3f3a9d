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

Each product also takes `operand_dtype`: its operands are rounded to that dtype
(bfloat16 for mixed precision), the products accumulate in float32, and the
result comes back in the inputs' dtype, as do the gradients, whose own products
round their operands the same way. Accumulating in float32 is also what keeps a
bfloat16 product on XLA:CPU's fast kernels: a dot with a bfloat16 result runs
outside them, slower than in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

_NN = (((1,), (0,)), ((), ()))  # [N, K] . [K, M]
_NT = (((1,), (1,)), ((), ()))  # [N, K] . [M, K]


def _rounded(x: jax.Array, operand_dtype: jnp.dtype | None) -> jax.Array:
    return x if operand_dtype is None else x.astype(operand_dtype)


def _promoted(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Both operands in their common dtype, the dtype of the product and of both gradients."""
    dtype = jnp.result_type(a, b)
    return a.astype(dtype), b.astype(dtype)


def _dot(a: jax.Array, b: jax.Array, dims: lax.DotDimensionNumbers, out_dtype) -> jax.Array:
    """`lax.dot_general` accumulated in float32, returned as `out_dtype`."""
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(out_dtype)


def _materialized_transpose(x: jax.Array, axes: Sequence[int]) -> jax.Array:
    """`jnp.transpose(x, axes)` as a real copy, which XLA will not fold into a consumer dot."""
    transposed = jnp.transpose(x, axes)
    if x.dtype == jnp.float32:
        return lax.optimization_barrier(transposed)
    # XLA:CPU decides which dots it can run on bfloat16 operands while a transpose
    # is still a layout, and runs such an operand's dot on float32 copies; taken
    # flat through the barrier, the transposed copy is an ordinary array to it.
    flat = lax.optimization_barrier(transposed.reshape(-1))
    return flat.reshape(transposed.shape)


def _product_transposed(a_MN: jax.Array, b_NK: jax.Array, out_dtype) -> jax.Array:
    """(a @ b)^T [K, M], the product kept whole before the transpose.

    Without the barrier on the product, XLA rewrites transpose(a @ b) as a dot
    contracting b over its first dimension: the slow kind again.
    """
    return _materialized_transpose(
        lax.optimization_barrier(_dot(a_MN, b_NK, _NN, out_dtype)), (1, 0)
    )


def _rounded_product(product, gradients):
    """`f(a, b, operand_dtype)`: a product of two operands with a custom VJP.

    The operands are first promoted to their common dtype, which the product and
    both gradients come back in. `product(a, b, out_dtype)` and
    `gradients(a, b, g, out_dtype)` see the operands and the output gradient g
    rounded to `operand_dtype` (None: as given); the rounded operands are the
    residuals kept for the backward pass.
    """

    @partial(jax.custom_vjp, nondiff_argnums=(0,))
    def rounded_product(operand_dtype, a: jax.Array, b: jax.Array) -> jax.Array:
        return forward(operand_dtype, a, b)[0]

    def forward(operand_dtype, a: jax.Array, b: jax.Array):
        out_dtype = a.dtype
        a, b = _rounded(a, operand_dtype), _rounded(b, operand_dtype)
        return product(a, b, out_dtype), (a, b)

    def backward(operand_dtype, residuals, g: jax.Array):
        return gradients(*residuals, _rounded(g, operand_dtype), g.dtype)

    rounded_product.defvjp(forward, backward)
    return lambda a, b, operand_dtype: rounded_product(operand_dtype, *_promoted(a, b))


def dense_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: lax.DotDimensionNumbers,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    *,
    operand_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """`lax.dot_general` for a dense layer, with YNNPACK-friendly gradients.

    Takes the arguments of `lax.dot_general`, so it can be given to
    `flax.linen.Dense(dot_general=...)` and `DenseGeneral` (with
    `functools.partial` for `operand_dtype`). When `lhs`'s last n dimensions
    are contracted with `rhs`'s first n, in order, and there are no batch
    dimensions (every dense layer of this model), the product and both
    gradients are computed as one 2-D matmul each: [N, K] x [K, M] forward,
    g [N, M] x w^T for the input gradient, and x^T [K, N] x g [N, M] (or
    (g^T [M, N] x x [N, K])^T when M < K, to transpose the smaller array) for
    the weight gradient, each with its operands rounded to `operand_dtype`
    (None: as given). Any other dimension numbers, or an explicit `precision`,
    go to `lax.dot_general` unchanged, `operand_dtype` aside.
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
        out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
        lhs, rhs = _rounded(lhs, operand_dtype), _rounded(rhs, operand_dtype)
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, out_dtype)
    k = math.prod(rhs.shape[:n])
    out_shape = lhs.shape[: lhs.ndim - n] + rhs.shape[n:]
    x_NK = lhs.reshape(-1, k)
    w_KM = rhs.reshape(k, -1)
    if preferred_element_type is not None:
        x_NK = x_NK.astype(preferred_element_type)
        w_KM = w_KM.astype(preferred_element_type)
    return _matmul(x_NK, w_KM, operand_dtype).reshape(out_shape)


def _matmul_gradients(x_NK: jax.Array, w_KM: jax.Array, g_NM: jax.Array, out_dtype):
    dx_NK = _dot(g_NM, w_KM, _NT, out_dtype)
    if w_KM.shape[0] <= w_KM.shape[1]:
        dw_KM = _dot(_materialized_transpose(x_NK, (1, 0)), g_NM, _NN, out_dtype)
    else:
        dw_KM = _product_transposed(_materialized_transpose(g_NM, (1, 0)), x_NK, out_dtype)
    return dx_NK, dw_KM


_matmul = _rounded_product(lambda x, w, out_dtype: _dot(x, w, _NN, out_dtype), _matmul_gradients)


def matmul_transposed(
    x: jax.Array, w_MK: jax.Array, operand_dtype: jnp.dtype | None = None
) -> jax.Array:
    """x [..., K] @ w^T for w [M, K] (a tied output projection), with YNNPACK-friendly gradients.

    The gradient of w is computed as (x^T g)^T: x [N, K] is the operand
    transposed, not the logit gradient g [N, M], which is far larger when M is
    the vocabulary.

    Args:
      x: [..., K].
      w_MK: [M, K], e.g. an embedding table [vocab, d_model].
      operand_dtype: the dtype the products' operands are rounded to; None
        keeps them as they are.

    Returns:
      [..., M], in the inputs' dtype.
    """
    k = w_MK.shape[1]
    logits_NM = _matmul_nt(x.reshape(-1, k), w_MK, operand_dtype)
    return logits_NM.reshape(*x.shape[:-1], w_MK.shape[0])


def _matmul_nt_gradients(x_NK: jax.Array, w_MK: jax.Array, g_NM: jax.Array, out_dtype):
    dx_NK = _dot(g_NM, w_MK, _NN, out_dtype)
    dw_MK = _product_transposed(_materialized_transpose(x_NK, (1, 0)), g_NM, out_dtype)
    return dx_NK, dw_MK


_matmul_nt = _rounded_product(
    lambda x, w, out_dtype: _dot(x, w, _NT, out_dtype), _matmul_nt_gradients
)


def _scores(q_BQHD: jax.Array, k_BKHD: jax.Array, out_dtype) -> jax.Array:
    scores_BHQK = jnp.einsum("bqhd,bkhd->bhqk", q_BQHD, k_BKHD, preferred_element_type=jnp.float32)
    return scores_BHQK.astype(out_dtype)


def _weighted_sum(weights_BHQK: jax.Array, v_BKHD: jax.Array, out_dtype) -> jax.Array:
    out_BQHD = jnp.einsum(
        "bhqk,bkhd->bqhd", weights_BHQK, v_BKHD, preferred_element_type=jnp.float32
    )
    return out_BQHD.astype(out_dtype)


def _swap_last_two(x_BHXY: jax.Array) -> jax.Array:
    """[batch, heads, x, y] -> [batch, heads, y, x] as a real copy (see the module docstring)."""
    return _materialized_transpose(x_BHXY, (0, 1, 3, 2))


# Each product's gradients are the two products again: the one contracting the
# last dimension of a [batch, heads, ., .] operand is given it transposed.


def attention_scores(
    q_BQHD: jax.Array, k_BKHD: jax.Array, operand_dtype: jnp.dtype | None = None
) -> jax.Array:
    """Q K^T per head: `einsum("bqhd,bkhd->bhqk")`, with YNNPACK-friendly gradients.

    Args:
      q_BQHD: queries [batch, q_len, heads, d_k].
      k_BKHD: keys [batch, kv_len, heads, d_k].
      operand_dtype: the dtype the products' operands are rounded to; None
        keeps them as they are.

    Returns:
      [batch, heads, q_len, kv_len], in the inputs' dtype.
    """
    return _attention_scores(q_BQHD, k_BKHD, operand_dtype)


def _attention_scores_gradients(q_BQHD: jax.Array, k_BKHD: jax.Array, g_BHQK: jax.Array, out_dtype):
    dq_BQHD = _weighted_sum(g_BHQK, k_BKHD, out_dtype)
    dk_BKHD = _weighted_sum(_swap_last_two(g_BHQK), q_BQHD, out_dtype)
    return dq_BQHD, dk_BKHD


_attention_scores = _rounded_product(_scores, _attention_scores_gradients)


def attend(
    weights_BHQK: jax.Array, v_BKHD: jax.Array, operand_dtype: jnp.dtype | None = None
) -> jax.Array:
    """Values weighted per head, `einsum("bhqk,bkhd->bqhd")`, with YNNPACK-friendly gradients.

    Args:
      weights_BHQK: attention weights [batch, heads, q_len, kv_len].
      v_BKHD: values [batch, kv_len, heads, d_v].
      operand_dtype: the dtype the products' operands are rounded to; None
        keeps them as they are.

    Returns:
      [batch, q_len, heads, d_v], in the inputs' dtype.
    """
    return _attend(weights_BHQK, v_BKHD, operand_dtype)


def _attend_gradients(weights_BHQK: jax.Array, v_BKHD: jax.Array, g_BQHD: jax.Array, out_dtype):
    dweights_BHQK = _scores(g_BQHD, v_BKHD, out_dtype)
    dv_BKHD = _weighted_sum(_swap_last_two(weights_BHQK), g_BQHD, out_dtype)
    return dweights_BHQK, dv_BKHD


_attend = _rounded_product(_weighted_sum, _attend_gradients)
