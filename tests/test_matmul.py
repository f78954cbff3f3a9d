"""transformer.matmul: the plain products' values and gradients, run as library kernels."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax import lax

from transformer import Transformer, TransformerConfig
from transformer.matmul import attend, attention_scores, dense_dot_general, matmul_transposed

# The compiled programs below are looked into: compile them as training does.
pytestmark = pytest.mark.usefixtures("full_optimization")

_DENSE_DIMS = (((2,), (0,)), ((), ()))  # x [B, L, K] . w [K, M], as flax's Dense
_HEADS_DIMS = (((2, 3), (0, 1)), ((), ()))  # x [B, L, H, D] . w [H, D, M], as the W^O projection


def _dense(dims):
    return lambda x, w, **kwargs: dense_dot_general(x, w, dims, **kwargs)


def _plain_dense(dims):
    return lambda x, w: lax.dot_general(x, w, dims)


# (name, product, its plain form, operand shapes): every operand dimension is
# at least 8, the size below which XLA:CPU keeps a dot out of YNNPACK.
CASES = [
    ("dense", _dense(_DENSE_DIMS), _plain_dense(_DENSE_DIMS), [(8, 16, 32), (32, 64)]),
    ("dense, input wider", _dense(_DENSE_DIMS), _plain_dense(_DENSE_DIMS), [(8, 16, 64), (64, 32)]),
    (
        "dense over heads",
        _dense(_HEADS_DIMS),
        _plain_dense(_HEADS_DIMS),
        [(8, 16, 8, 8), (8, 8, 32)],
    ),
    ("tied projection", matmul_transposed, lambda x, w: x @ w.T, [(8, 16, 32), (96, 32)]),
    (
        "attention scores",
        attention_scores,
        lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k),
        [(8, 16, 8, 32), (8, 24, 8, 32)],
    ),
    (
        "attend",
        attend,
        lambda p, v: jnp.einsum("bhqk,bkhd->bqhd", p, v),
        [(8, 8, 16, 24), (8, 24, 8, 32)],
    ),
]
IDS = [case[0] for case in CASES]


def _operands(shapes):
    keys = jax.random.split(jax.random.PRNGKey(0), len(shapes))
    return [jax.random.normal(key, shape) for key, shape in zip(keys, shapes, strict=True)]


def _loss(product):
    # A non-linear loss, so that the output gradient differs per element.
    return lambda a, b: jnp.sum(jnp.sin(product(a, b)))


@pytest.mark.parametrize("name,product,plain,shapes", CASES, ids=IDS)
def test_values_and_gradients_equal_the_plain_product(name, product, plain, shapes):
    a, b = _operands(shapes)
    np.testing.assert_allclose(product(a, b), plain(a, b), rtol=1e-5, atol=1e-5)
    grads = jax.grad(_loss(product), argnums=(0, 1))(a, b)
    plain_grads = jax.grad(_loss(plain), argnums=(0, 1))(a, b)
    for grad, plain_grad in zip(grads, plain_grads, strict=True):
        assert grad.shape == plain_grad.shape
        np.testing.assert_allclose(grad, plain_grad, rtol=1e-4, atol=1e-4)


def _to_bfloat16_values(x):
    """x rounded to bfloat16, kept in float32."""
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def _with_bfloat16_operands(product):
    return lambda a, b: product(a, b, operand_dtype=jnp.bfloat16)


@pytest.mark.parametrize("name,product,plain,shapes", CASES, ids=IDS)
def test_bfloat16_operands_give_the_product_of_the_rounded_operands(name, product, plain, shapes):
    a, b = _operands(shapes)
    ours = _with_bfloat16_operands(product)
    out = ours(a, b)
    assert out.dtype == jnp.float32
    # A product of bfloat16 values is exact in float32: only the sums round.
    rounded = plain(_to_bfloat16_values(a), _to_bfloat16_values(b))
    np.testing.assert_allclose(out, rounded, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(out - plain(a, b))).max() > 1e-3  # the operands were rounded


@pytest.mark.parametrize("name,product,plain,shapes", CASES, ids=IDS)
def test_bfloat16_operands_keep_float32_gradients(name, product, plain, shapes):
    a, b = _operands(shapes)
    out, vjp = jax.vjp(_with_bfloat16_operands(product), a, b)
    g = jax.random.normal(jax.random.PRNGKey(1), out.shape)
    # Each gradient product rounds its operands (g among them) and sums in float32.
    _, plain_vjp = jax.vjp(plain, _to_bfloat16_values(a), _to_bfloat16_values(b))
    expected = plain_vjp(_to_bfloat16_values(g))
    for grad, want in zip(vjp(g), expected, strict=True):
        assert grad.dtype == jnp.float32
        np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)
        # Not rounded to bfloat16 on the way out, as a cast in front of the product would.
        assert np.any(np.asarray(grad) != np.asarray(_to_bfloat16_values(grad)))


@pytest.mark.parametrize("narrow", [0, 1], ids=["first bfloat16", "second bfloat16"])
@pytest.mark.parametrize("name,product,plain,shapes", CASES[:1] + CASES[3:], ids=IDS[:1] + IDS[3:])
def test_operands_of_two_dtypes_give_their_common_dtype_and_gradients_of_their_own(
    name, product, plain, shapes, narrow
):
    operands = _operands(shapes)
    # A library user's mixed inputs (the model promotes first), either one the narrower.
    operands[narrow] = operands[narrow].astype(jnp.bfloat16)
    out, vjp = jax.vjp(product, *operands)
    assert out.dtype == jnp.float32
    wide = [x.astype(jnp.float32) for x in operands]
    np.testing.assert_allclose(out, plain(*wide), rtol=1e-5, atol=1e-5)
    grads = vjp(jnp.ones_like(out))
    assert [g.dtype for g in grads] == [x.dtype for x in operands]


@pytest.mark.parametrize("name,product,plain,shapes", CASES, ids=IDS)
def test_bfloat16_inputs_give_bfloat16_products_and_gradients(name, product, plain, shapes):
    # The model's compute dtype bfloat16 (without matmul_dtype): inputs, product and
    # gradients all bfloat16, the sums taken in float32 and rounded once.
    a, b = (x.astype(jnp.bfloat16) for x in _operands(shapes))
    out, vjp = jax.vjp(product, a, b)
    assert out.dtype == jnp.bfloat16
    wide_a, wide_b = a.astype(jnp.float32), b.astype(jnp.float32)
    np.testing.assert_allclose(out.astype(jnp.float32), plain(wide_a, wide_b), rtol=1e-2, atol=1e-2)
    g = jax.random.normal(jax.random.PRNGKey(1), out.shape).astype(jnp.bfloat16)
    _, plain_vjp = jax.vjp(plain, wide_a, wide_b)
    for grad, want in zip(vjp(g), plain_vjp(g.astype(jnp.float32)), strict=True):
        assert grad.dtype == jnp.bfloat16
        np.testing.assert_allclose(grad.astype(jnp.float32), want, rtol=1e-2, atol=1e-2)


def test_other_dimension_numbers_or_a_precision_go_to_dot_general_operands_rounded():
    x, w = _operands([(8, 16, 32), (8, 32, 24)])
    batched = (((2,), (1,)), ((0,), (0,)))  # a batch dimension: not a dense layer's product
    out = dense_dot_general(x, w, batched, operand_dtype=jnp.bfloat16)
    rounded = lax.dot_general(_to_bfloat16_values(x), _to_bfloat16_values(w), batched)
    np.testing.assert_allclose(out, rounded, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(out - lax.dot_general(x, w, batched))).max() > 1e-3
    # An explicit precision is kept (on GPUs and TPUs the default is lower than HIGHEST).
    highest = jax.make_jaxpr(
        lambda x, w: dense_dot_general(x, w, _DENSE_DIMS, precision=lax.Precision.HIGHEST)
    )(x, w[0])
    precisions = [e.params["precision"] for e in highest.eqns if e.primitive.name == "dot_general"]
    assert precisions == [(lax.Precision.HIGHEST, lax.Precision.HIGHEST)]


# (dimension numbers, lhs shape, rhs shape): products that are not a dense layer's,
# each close to one (contracted dims at the ends, or of the same total size).
NOT_DENSE = [
    ((((0,), (0,)), ((), ())), (8, 16), (8, 24)),  # x^T w: lhs contracted over its first dim
    ((((2,), (1,)), ((), ())), (4, 8, 16), (24, 16)),  # x w^T: rhs contracted over its last
    ((((2, 1), (0, 1)), ((), ())), (4, 6, 8), (8, 6, 24)),  # lhs's last two, out of order
    ((((1, 2), (1, 0)), ((), ())), (4, 8, 6), (6, 8, 24)),  # rhs's first two, out of order
    ((((2,), (0,)), ((0,), (1,))), (4, 8, 16), (16, 4, 24)),  # batched, contracted in place
]


@pytest.mark.parametrize(
    "dims,lhs_shape,rhs_shape",
    NOT_DENSE,
    ids=["lhs first", "rhs last", "lhs out of order", "rhs out of order", "batched"],
)
def test_products_other_than_a_dense_layers_equal_dot_general(dims, lhs_shape, rhs_shape):
    x, w = _operands([lhs_shape, rhs_shape])
    want = lax.dot_general(x, w, dims)
    out = dense_dot_general(x, w, dims)
    assert out.shape == want.shape
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_dimension_numbers_dot_general_rejects_are_rejected():
    # A batch dimension on one side only: not a dense layer's product with one ignored.
    x, w = _operands([(4, 8, 16), (16, 24)])
    with pytest.raises(TypeError, match="batch"):  # as lax.dot_general raises
        dense_dot_general(x, w, (((2,), (0,)), ((0,), ())))


@pytest.mark.parametrize(
    "dims", [_DENSE_DIMS, (((2,), (1,)), ((0,), (0,)))], ids=["dense", "batched"]
)
@pytest.mark.parametrize(
    "dtypes",
    [
        (jnp.bfloat16, jnp.bfloat16, jnp.float32),
        (jnp.bfloat16, jnp.float32, jnp.bfloat16),
        (jnp.float32, jnp.bfloat16, jnp.bfloat16),
        (jnp.bfloat16, jnp.float32, None),
        (jnp.float32, jnp.bfloat16, None),
    ],
    ids=["bf16 to f32", "bf16 f32 to bf16", "f32 bf16 to bf16", "bf16 f32", "f32 bf16"],
)
def test_the_result_dtype_is_dot_generals(dims, dtypes):
    # As lax.dot_general: preferred_element_type when given, else the operands' common dtype.
    lhs_dtype, rhs_dtype, preferred = dtypes
    x, w = _operands([(8, 16, 32), (8, 32, 24) if dims != _DENSE_DIMS else (32, 24)])
    x, w = x.astype(lhs_dtype), w.astype(rhs_dtype)
    want = lax.dot_general(x, w, dims, preferred_element_type=preferred)
    out = dense_dot_general(x, w, dims, preferred_element_type=preferred)
    assert out.dtype == want.dtype
    if lhs_dtype == rhs_dtype:  # bfloat16 operands, a float32 result: no rounding of it
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def _copied_sizes(jaxpr) -> list[int]:
    """Sizes of the arrays a jaxpr (and the jaxprs inside it) copies through a barrier."""
    sizes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "optimization_barrier":
            sizes += [var.aval.size for var in eqn.invars]
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else [param]:
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(inner, "eqns"):
                    sizes += _copied_sizes(inner)
    return sizes


@pytest.mark.parametrize("name,product,plain,shapes", CASES[:4], ids=IDS[:4])
def test_the_weight_gradient_copies_the_smaller_of_input_and_output_gradient(
    name, product, plain, shapes
):
    # The transposed copy is of x [N, K] or of g [N, M], whichever is smaller (x for the
    # tied projection, where g has the vocabulary's width), besides the weight-sized product.
    x, w = _operands(shapes)
    g_size = product(x, w).size
    jaxpr = jax.make_jaxpr(jax.grad(_loss(product), argnums=(0, 1)))(x, w).jaxpr
    sizes = _copied_sizes(jaxpr)
    assert sizes  # the copies are there to be looked at
    assert max(sizes) <= max(min(x.size, g_size), w.size), (sizes, x.size, g_size, w.size)


def _unfused_dots(hlo_text: str) -> list[str]:
    """The dot instructions of compiled HLO that are not inside a fusion (XLA:CPU's Eigen dots)."""
    fused = set(re.findall(r" fusion\(.*calls=%([\w.\-]+)", hlo_text))
    dots, computation = [], None
    for line in hlo_text.splitlines():
        header = re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if header:
            computation = header.group(1)
        elif computation not in fused and re.search(r"= \S+ dot\(", line):
            dots.append(line.strip())
    return dots


def _gradient_hlo(product, shapes) -> str:
    grad = jax.jit(jax.grad(_loss(product), argnums=(0, 1)))
    return grad.lower(*_operands(shapes)).compile().as_text()


def _skip_unless_cpu_runs_matmuls_in_ynnpack():
    if jax.default_backend() != "cpu":
        pytest.skip("a property of XLA:CPU's compiled programs")
    a, b = _operands([(16, 32), (32, 16)])
    if "ynn_fusion" not in jax.jit(jnp.matmul).lower(a, b).compile().as_text():
        pytest.skip("this jaxlib's XLA:CPU does not run matmuls as YNNPACK fusions")


@pytest.mark.parametrize("name,product,plain,shapes", CASES[:4], ids=IDS[:4])
def test_every_gradient_matmul_runs_in_the_matmul_library_on_cpu(name, product, plain, shapes):
    _skip_unless_cpu_runs_matmuls_in_ynnpack()
    assert _unfused_dots(_gradient_hlo(product, shapes)) == []
    if name == "dense":
        # The reason for the module: the plain layer's weight gradient is a dot YNNPACK refuses.
        assert _unfused_dots(_gradient_hlo(plain, shapes))


def _tiny_model_gradient_hlo(**settings) -> str:
    """Compiled HLO of a small model's training gradient, with config `settings`."""
    # Every dimension at least 8 (d_head 16), so XLA:CPU would give each dot to YNNPACK.
    cfg = TransformerConfig.preset("tiny", vocab_size=64, num_heads=2, **settings)
    model = Transformer(cfg)
    src, tgt = (jnp.full((8, 16), 5, jnp.int32) for _ in range(2))
    params = model.init(jax.random.PRNGKey(0), src, tgt)

    def loss(params):
        rngs = {"dropout": jax.random.PRNGKey(1)}
        return jnp.sum(jnp.sin(model.apply(params, src, tgt, train=True, rngs=rngs)))

    return jax.jit(jax.grad(loss)).lower(params).compile().as_text()


def test_the_model_gradient_has_no_eigen_dots_on_cpu():
    _skip_unless_cpu_runs_matmuls_in_ynnpack()
    hlo = _tiny_model_gradient_hlo()
    assert "ynn_fusion" in hlo
    assert _unfused_dots(hlo) == []


def _dot_operand_dtypes(hlo_text: str) -> list[tuple[str, str]]:
    """(lhs, rhs) element types of every dot in compiled HLO, fused or not."""
    dtypes, pairs = {}, []
    for line in hlo_text.splitlines():
        defined = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[", line)
        if defined:
            dtypes[defined.group(1)] = defined.group(2)
        dot = re.search(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", line)
        if dot:  # operands are defined before use within a computation
            pairs.append((dtypes[dot.group(1)], dtypes[dot.group(2)]))
    return pairs


@pytest.mark.parametrize(
    "settings", [dict(matmul_dtype="bfloat16"), dict(dtype="bfloat16")], ids=["matmul", "compute"]
)
def test_bfloat16_model_gradient_runs_bfloat16_dots_in_the_matmul_library_on_cpu(settings):
    _skip_unless_cpu_runs_matmuls_in_ynnpack()
    # A bfloat16 dot with a bfloat16 result runs on float32 copies of its operands;
    # accumulating in float32 is what gives the library the bfloat16 operands.
    hlo = _tiny_model_gradient_hlo(**settings)
    assert _unfused_dots(hlo) == []
    pairs = _dot_operand_dtypes(hlo)
    assert len(pairs) >= 40  # 6 per layer forward, more backward
    assert set(pairs) == {("bf16", "bf16")}


def test_flax_dense_with_the_dot_has_the_same_parameters_and_outputs():
    x = _operands([(4, 8, 16)])[0]
    plain = nn.Dense(32)
    ours = nn.Dense(32, dot_general=dense_dot_general)
    params = plain.init(jax.random.PRNGKey(1), x)
    ours_params = ours.init(jax.random.PRNGKey(1), x)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, ours_params)
    np.testing.assert_allclose(ours.apply(params, x), plain.apply(params, x), rtol=1e-6)
