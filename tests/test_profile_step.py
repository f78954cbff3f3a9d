"""profile_step counts as matmuls exactly the compiled ops that multiply matrices, and
counts each op's time once."""

import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks import profile_step
from benchmarks.profile_step import is_matmul, leaf_op_durations, matmul_fusions

# The compiled programs below are looked into: compile them as the benchmark does.
pytestmark = pytest.mark.usefixtures("full_optimization")


def compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def test_a_fusion_around_a_dot_is_a_matmul_and_other_fusions_are_not():
    a, b = jnp.ones((256, 128)), jnp.ones((128, 256))
    text = compiled_text(lambda a, b: (a @ b).sum(axis=0) + jnp.exp(a).sum(), a, b)
    fusions = matmul_fusions(text)
    if not fusions and "ynn_fusion" not in text:
        # XLA before its YNNPACK fusions (JAX 0.6) runs the dot unfused, as a dot op.
        dots = re.findall(r"%(dot[\w.]*) = ", text)
        assert dots and all(is_matmul(dot, fusions) for dot in dots)
        return
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


def op(name, ts, dur, tid=1):
    return {"ph": "X", "pid": 7, "tid": tid, "ts": ts, "dur": dur, "name": name}


def test_ops_inside_a_while_count_once_and_runtime_events_not_at_all():
    events = [
        op("PmapFunction(train_step)", 0.0, 100.0),
        op("ParseArguments", 0.5, 2.0),
        op("DevicePut", 3.0, 1.0),
        op("Wait for donation holds", 4.0, 0.5),
        op("Wait for usage holds", 4.5, 0.5),
        op("ThunkExecutor::Execute", 5.0, 90.0),
        op("ynn_fusion.1", 10.0, 20.0),
        op("while.5", 30.0, 50.0),  # its body: a fusion, a call holding a copy, a copy
        op("ynn_fusion.2", 30.0, 10.0),
        op("call.3", 41.0, 20.0),
        op("copy.4", 45.0, 5.0),
        op("copy.4", 62.0, 8.0),
        op("copy.4", 30.0, 40.0, tid=2),  # on another thread at the same time: a leaf
        op("end: copy.4", 70.0, 0.1),
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]
    totals, counts = leaf_op_durations(events)
    assert totals == {"ynn_fusion.1": 20.0, "ynn_fusion.2": 10.0, "copy.4": 53.0}
    assert counts == {"ynn_fusion.1": 1, "ynn_fusion.2": 1, "copy.4": 3}
    # The outer ops count where nothing inside them was traced.
    totals, counts = leaf_op_durations([op("while.5", 0.0, 9.0), op("call.3", 9.0, 1.0)])
    assert totals == {"while.5": 9.0, "call.3": 1.0}


def test_zero_traced_steps_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        profile_step.main(["--steps", "0"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("error: --steps must be at least 1")
