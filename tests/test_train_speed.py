"""benchmarks/train_speed.py's figures: the model FLOPs, the peak, tokens/s and their ratio,
which the README's utilization table is made of."""

import os
import subprocess
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from benchmarks import train_speed
from tests.make_tiny_workdir import ROOT
from transformer import Transformer, TransformerConfig


def _jaxprs_in(value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _jaxprs_in(item)


def traced_matmul_flops(jaxpr) -> int:
    """2 x the multiply-adds of every dot_general of a jaxpr, those of its sub-jaxprs too."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs_shape = eqn.invars[0].aval.shape
            contracted = int(np.prod([lhs_shape[i] for i in lhs_contract], dtype=np.int64))
            total += 2 * int(np.prod(eqn.outvars[0].aval.shape, dtype=np.int64)) * contracted
        repeats = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in _jaxprs_in(value):
                total += repeats * traced_matmul_flops(sub)
    return total


def test_the_model_flops_are_the_matmuls_jax_traces():
    # An independent count: every size distinct, so a term dropped or counted twice, a
    # length swapped or the decoder counted with the encoder's depth changes the sum.
    config = TransformerConfig.preset(
        "tiny", d_ff=48, num_encoder_layers=1, num_decoder_layers=3, vocab_size=37
    )
    rows, src_len, tgt_len = 2, 5, 7
    model = Transformer(config)
    src = jnp.full((rows, src_len), 5, jnp.int32)
    tgt = jnp.full((rows, tgt_len), 6, jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), src, tgt)["params"]  # traced only

    def forward(params):
        return model.apply({"params": params}, src, tgt)

    def loss(params):
        return jnp.sum(forward(params) ** 2)

    once = traced_matmul_flops(jax.make_jaxpr(forward)(params).jaxpr)
    step = traced_matmul_flops(jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr)
    assert step == 3 * once  # the backward pass: two matmuls for each of the forward's
    assert train_speed.model_flops_per_step(config, rows, src_len, tgt_len) == step


def test_the_peak_is_two_size_cubed_per_second_summed_over_the_devices():
    # Each matmul "takes" 1 s of a faked clock, on 2 devices.
    code = (
        "from benchmarks import train_speed\n"
        "clock = iter(range(100))\n"
        "train_speed.time.perf_counter = lambda: float(next(clock))\n"
        "print(train_speed.make_peak_probe(8)())\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) == 2 * 2.0 * 8**3


def test_the_printed_figures_are_computed_from_the_timings(monkeypatch, capsys, tmp_path):
    peaks = iter([3e9, 1e9, 2e9, 1e9, 1e9, 1e9, 8e9, 1e9, 1e9])  # the best 8e9, the median 1e9
    dtypes = []

    def probe(size, dtype="float32"):
        dtypes.append(dtype)
        return lambda: next(peaks)

    def timed(cfg, rows, src_len, tgt_len, steps, between_steps, every=5):
        for _ in range(4):
            between_steps()
        return 2.0, 0.5  # the first step (compiling), then the median step, in seconds

    monkeypatch.setattr(train_speed, "make_peak_probe", probe)
    monkeypatch.setattr(train_speed, "time_train_step", timed)
    rows, src_len, tgt_len = 4 * jax.local_device_count(), 3, 5
    train_speed.main(
        ["--presets", "tiny", "--rows", str(rows), "--src-len", str(src_len)]
        + ["--tgt-len", str(tgt_len), "--matmul-dtype", "bfloat16"]
        + ["--data-dir", str(tmp_path / "none")]
    )
    assert dtypes == ["bfloat16"]  # the peak of the step's own matmul dtype
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if line.startswith(f"tiny: {rows} x")]
    config = TransformerConfig.preset(
        "tiny", vocab_size=train_speed.DATA_DEFAULTS["vocab_size"], matmul_dtype="bfloat16"
    )
    flops = train_speed.model_flops_per_step(config, rows, src_len, tgt_len)
    assert f"{rows * tgt_len / 0.5:,.0f} target tokens/s" in line  # target tokens only
    assert f"utilization {flops / 0.5 / 8e9:.1%}" in line  # over the best peak
    assert "peak matmul: 8.0 GFLOP/s" in out


def test_the_timed_batch_holds_no_padding_or_special_ids():
    config = TransformerConfig.preset("tiny", vocab_size=6)
    *_, batch = train_speed.make_step_inputs(config, 8 * jax.local_device_count(), 16, 16)
    for key in ("src", "tgt_in", "tgt_out"):
        assert batch[key].min() >= 4  # 0 to 3: pad, unk, bos, eos
