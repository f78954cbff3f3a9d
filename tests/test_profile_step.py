"""profile_step counts as matmuls exactly the compiled ops that multiply matrices, and
counts each op's time once."""

import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks import profile_step
from benchmarks.profile_step import is_matmul, leaf_op_durations, matmul_fusions
from train import DEFAULT_PRESET

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
    # A fusion is a matmul by what its computation holds, not by its name.
    assert not is_matmul("gemm_fusion.4", set())


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
    with pytest.raises(SystemExit) as exit_:
        profile_step.main(["--top", "0"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("error: --top must be at least 1")


def test_the_printed_table_is_each_ops_time_per_step_summed_by_kind_and_ranked(monkeypatch, capsys):
    # Two traced steps (microseconds and events for both): ynn_fusion.1 holds a dot.
    totals = {"ynn_fusion.1": 8e3, "ynn_fusion.2": 2e3, "dot.3": 6e3, "copy.4": 1e3, "copy.5": 3e3}
    counts = {"ynn_fusion.1": 2, "ynn_fusion.2": 2, "dot.3": 2, "copy.4": 4, "copy.5": 2}
    step = jax.jit(lambda state, batch: (state + batch, state))
    monkeypatch.setattr(profile_step, "make_step_inputs", lambda *a: (step, 0.0, 1.0))
    monkeypatch.setattr(profile_step, "matmul_fusions", lambda text: {"ynn_fusion.1"})
    monkeypatch.setattr(profile_step, "op_durations", lambda trace_dir: (totals, counts))
    monkeypatch.setattr(profile_step, "keep_freed_host_memory", lambda: False)
    monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: None)
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
    rows, n = 2 * jax.local_device_count(), jax.local_device_count()
    flags = ["--rows", str(rows), "--src-len", "3", "--tgt-len", "5"]  # train.py's preset
    profile_step.main([*flags, "--steps", "2", "--top", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0]
        == f"{DEFAULT_PRESET}: {rows} x (3 src + 5 tgt) tokens, {n} device(s), 2 traced steps"
    )
    # Per step: ynn_fusion.1 4 ms and dot.3 3 ms are matmuls; 1 + 0.5 + 1.5 ms are not.
    assert lines[1] == "op time per step: matmul 7.0 ms, other 3.0 ms (matmul share 70.0%)"
    assert lines[2] == "op kinds by time (ms per step, ops per step), the first 2:"
    # The top two kinds (copy's 2 ms and 3 events per step are third), then the two slowest ops.
    rest = [line.split() for line in lines[3:]]
    assert rest == [
        ["ynn_fusion", "5.00", "2"],
        ["dot", "3.00", "1"],
        ["slowest", "2", "ops", "(ms", "per", "step):"],
        ["ynn_fusion.1", "4.00", "matmul"],
        ["dot.3", "3.00", "matmul"],
    ]


def test_a_trace_folder_without_a_perfetto_trace_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="^error: jax.profiler wrote no perfetto_trace"):
        profile_step.op_durations(tmp_path)


def test_a_trace_written_as_a_bare_event_list_is_read(tmp_path):
    import gzip
    import json

    path = tmp_path / "plugins" / "profile" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    for trace in ([op("copy.4", 0.0, 2.0)], {"traceEvents": [op("copy.4", 0.0, 2.0)]}):
        with gzip.open(path, "wt") as f:
            json.dump(trace, f)
        assert profile_step.op_durations(tmp_path) == ({"copy.4": 2.0}, {"copy.4": 1})


def test_a_fusion_whose_nested_fusion_holds_the_dot_is_a_matmul():
    text = "\n".join(
        [
            "%inner (p: f32[2,2]) -> f32[2,2] {",
            "  ROOT %dot.1 = f32[2,2] dot(%p, %p), lhs_contracting_dims={1}",
            "}",
            "%outer (p: f32[2,2]) -> f32[2,2] {",
            "  ROOT %fusion.2 = f32[2,2] fusion(%p), kind=kOutput, calls=%inner",
            "}",
            "%plain (p: f32[2,2]) -> f32[2,2] {",
            "  ROOT %exp.3 = f32[2,2] exponential(%p)",
            "}",
            "ENTRY %main (x: f32[2,2]) -> f32[2,2] {",
            "  %ynn_fusion.4 = f32[2,2] fusion(%x), kind=kCustom, calls=%outer",
            "  ROOT %ynn_fusion.5 = f32[2,2] fusion(%ynn_fusion.4), kind=kCustom, calls=%plain",
            "}",
        ]
    )
    assert matmul_fusions(text) == {"ynn_fusion.4", "fusion.2"}


def test_events_of_other_phases_neither_count_nor_hide_the_op_they_fall_in():
    instant = {"ph": "i", "pid": 7, "tid": 1, "ts": 5.0, "name": "marker"}
    counter = {"ph": "C", "pid": 7, "tid": 1, "ts": 6.0, "name": "memory", "args": {}}
    totals, counts = leaf_op_durations([op("copy.4", 0.0, 10.0), instant, counter])
    assert totals == {"copy.4": 10.0} and counts == {"copy.4": 1}
