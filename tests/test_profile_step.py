"""profile_step counts as matmuls exactly the compiled ops that multiply matrices."""

import jax
import jax.numpy as jnp

from benchmarks.profile_step import is_matmul, matmul_fusions


def compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def test_a_fusion_around_a_dot_is_a_matmul_and_other_fusions_are_not():
    a, b = jnp.ones((256, 128)), jnp.ones((128, 256))
    text = compiled_text(lambda a, b: (a @ b).sum(axis=0) + jnp.exp(a).sum(), a, b)
    fusions = matmul_fusions(text)
    assert len(fusions) == 1
    (name,) = fusions
    assert is_matmul(name, fusions)
    # Every other fusion of the program (the reductions, the add) is not a matmul.
    others = {
        line.split(" = ")[0].strip().removeprefix("ROOT ").lstrip("%")
        for line in text.splitlines()
        if " fusion(" in line
    } - fusions
    assert others
    assert not any(is_matmul(other, fusions) for other in others)


def test_a_reduction_run_as_a_library_fusion_is_not_a_matmul():
    # XLA:CPU runs this reduce_sum as a "ynn_fusion", the prefix its matmuls have.
    text = compiled_text(lambda a: jnp.sum(a, axis=1), jnp.ones((256, 128)))
    assert matmul_fusions(text) == set()


def test_unfused_dot_ops_count_by_name():
    assert is_matmul("dot.187", set())
    assert not is_matmul("copy_bitcast_fusion.12", set())
    assert not is_matmul("ynn_fusion.3", set())
