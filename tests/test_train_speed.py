"""benchmarks/train_speed.py's figures: the model FLOPs, the peak, tokens/s and their ratio,
which the README's utilization table is made of."""

import itertools
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


def _main_with_faked_timings(monkeypatch, capsys, argv, peaks=None, step=(2.0, 0.5)):
    """Runs train_speed.main(argv) with a faked peak probe (giving `peaks` in turn, else 1e9
    FLOP/s each time) and a faked step timing (4 calls between steps; `step`: the first
    step's seconds, then the median step's). Gives the output and the calls, in order:
    ("keep",) for keep_freed_host_memory, ("probe", size, dtype) and ("time", config, rows,
    src_len, tgt_len)."""
    peaks, calls = iter(peaks or itertools.repeat(1e9)), []

    def probe(size, dtype="float32"):
        calls.append(("probe", size, dtype))
        return lambda: next(peaks)

    def timed(cfg, rows, src_len, tgt_len, steps, between_steps, every=5):
        calls.append(("time", cfg, rows, src_len, tgt_len))
        for _ in range(4):
            between_steps()
        return step

    monkeypatch.setattr(train_speed, "keep_freed_host_memory", lambda: calls.append(("keep",)))
    monkeypatch.setattr(train_speed, "make_peak_probe", probe)
    monkeypatch.setattr(train_speed, "time_train_step", timed)
    train_speed.main(argv)
    return capsys.readouterr().out, calls


def test_the_printed_figures_are_computed_from_the_timings(monkeypatch, capsys, tmp_path):
    rows, src_len, tgt_len = 4 * jax.local_device_count(), 3, 5
    argv = ["--presets", "tiny", "--rows", str(rows), "--src-len", str(src_len)]
    argv += ["--tgt-len", str(tgt_len), "--matmul-dtype", "bfloat16", "--matmul-size", "96"]
    out, calls = _main_with_faked_timings(
        monkeypatch,
        capsys,
        [*argv, "--data-dir", str(tmp_path / "none")],
        peaks=[3e9, 1e9, 2e9, 1e9, 1e9, 1e9, 8e9, 1e9, 1e9],  # the best 8e9, the median 1e9
        step=(2.0, 0.5),  # the first step (compiling), then the median step, in seconds
    )
    config = TransformerConfig.preset(
        "tiny", vocab_size=train_speed.DATA_DEFAULTS["vocab_size"], matmul_dtype="bfloat16"
    )
    # Host memory is set up before anything runs; the peak is of the step's own matmul dtype
    # and the step timed is the model of the flags (vocabulary and matmul dtype).
    assert calls == [("keep",), ("probe", 96, "bfloat16"), ("time", config, rows, 3, 5)]
    flops = train_speed.model_flops_per_step(config, rows, src_len, tgt_len)
    assert (
        "peak matmul: 8.0 GFLOP/s (96^3 bfloat16, the best of 9 timed through the run; "
        "their median 1.0)"
    ) in out.splitlines()
    [line] = [line for line in out.splitlines() if line.startswith(f"tiny: {rows} x")]
    assert line == (
        f"tiny: {rows} x (3 src + 5 tgt) tokens: first step (compile) 2.0 s; 500 ms/step; "
        f"{rows * tgt_len / 0.5:,.0f} target tokens/s; "  # target tokens only
        f"{flops / 1e9:.1f} GFLOP/step; {flops / 0.5 / 1e9:.1f} GFLOP/s; "
        f"utilization {flops / 0.5 / 8e9:.1%}"  # over the best peak
    )


def test_the_default_times_train_pys_preset_and_base(monkeypatch, capsys, tmp_path):
    # The README's table gives each run's utilization beside base's, from one command.
    out, calls = _main_with_faked_timings(
        monkeypatch, capsys, ["--data-dir", str(tmp_path / "none")]
    )
    vocab_size = train_speed.DATA_DEFAULTS["vocab_size"]
    assert [call[1] for call in calls if call[0] == "time"] == [
        TransformerConfig.preset(name, vocab_size=vocab_size)
        for name in (train_speed.DEFAULT_PRESET, "base")
    ]
    assert f"\n{train_speed.DEFAULT_PRESET}: " in out and "\nbase: " in out


class _Pending:
    """A device result whose work is done, a fake clock advancing `seconds`, only when it
    is waited for (as a dispatched JAX computation)."""

    def __init__(self, clock, seconds, events):
        self.clock, self.seconds, self.events = clock, seconds, events

    def block_until_ready(self):
        self.events.append("wait")
        self.clock[0] += self.seconds
        return self


def _fake_clock(monkeypatch, events):
    """time.perf_counter as train_speed reads it: a clock each read of which is an event."""
    clock = [0.0]

    def perf_counter():
        events.append("clock")
        return clock[0]

    monkeypatch.setattr(train_speed.time, "perf_counter", perf_counter)
    return clock


def test_the_peak_probe_times_a_compiled_awaited_matmul_of_the_steps_dtype(monkeypatch):
    events, made = [], []
    clock = _fake_clock(monkeypatch, events)

    def pmap(f):  # each call's work takes 2 s, when waited for
        made.append(f)
        return lambda *args: _Pending(clock, 2.0, events)

    monkeypatch.setattr(train_speed.jax, "pmap", pmap)
    probe = train_speed.make_peak_probe(8, "bfloat16")
    assert events == ["wait"]  # run once (compiled) before any timing
    events.clear()
    assert probe() == jax.local_device_count() * 2 * 8**3 / 2.0
    assert events == ["clock", "wait", "clock"]  # the clock read after the matmul is done
    monkeypatch.undo()
    operands, matmul = made
    a = operands(jax.random.key(0))
    assert a.shape == (8, 8) and a.dtype == jnp.bfloat16
    assert matmul(a).dtype == jnp.float32  # accumulated in float32, as the step's matmuls


def test_the_step_time_is_the_median_awaited_step_after_the_compiling_one(monkeypatch):
    events = []
    clock = _fake_clock(monkeypatch, events)
    seconds = iter([10.0, 1.0, 2.0, 9.0, 3.0, 4.0, 5.0, 6.0])  # compiling, then 7 steps

    def step(state, batch):
        events.append("step")
        return state + 1, _Pending(clock, next(seconds), events)

    monkeypatch.setattr(train_speed, "make_step_inputs", lambda *args: (step, 0, {}))
    probed = []

    def between_steps():  # a peak sample: 100 s, not part of any step
        probed.append(events.count("step") - 1)
        clock[0] += 100.0

    config = TransformerConfig.preset("tiny", vocab_size=8)
    first, median = train_speed.time_train_step(config, 8, 4, 4, 7, between_steps)
    assert (first, median) == (10.0, 4.0)  # not the mean (30 / 7), nor with the first
    assert probed == [5]  # after every 5 timed steps
    assert events[:8] == ["clock", "step", "wait", "clock"] * 2  # each step waited for


def test_the_timed_batch_holds_no_padding_or_special_ids():
    config = TransformerConfig.preset("tiny", vocab_size=6)
    *_, batch = train_speed.make_step_inputs(config, 8 * jax.local_device_count(), 16, 16)
    for key in ("src", "tgt_in", "tgt_out"):
        assert batch[key].min() >= 4  # 0 to 3: pad, unk, bos, eos


def test_the_timed_step_updates_with_train_pys_adamw(monkeypatch):
    # train.py's weight decay makes the update AdamW's (decayed matrices); 0 was plain Adam.
    recipes = []
    make_optimizer = train_speed.make_optimizer

    def recording(recipe, d_model):
        recipes.append(recipe)
        return make_optimizer(recipe, d_model)

    monkeypatch.setattr(train_speed, "make_optimizer", recording)
    config = TransformerConfig.preset("tiny", vocab_size=8)
    train_speed.make_step_inputs(config, jax.local_device_count(), 2, 2)
    [recipe] = recipes
    assert recipe.weight_decay == train_speed.TRAIN_DEFAULTS["weight_decay"] > 0


def test_the_pipeline_line_counts_the_batches_train_py_makes(monkeypatch, multi30k_slice, tmp_path):
    # The shapes and padding of the default command's batches (3 devices: rows a multiple of
    # 24, not 8), with the tokenizer train.py asks for (a 400-piece one here, trained once),
    # on 1000 lines of Multi30k.
    import data
    import train

    asked, trained, load_or_train = [], {}, data.load_or_train_tokenizer

    def load_or_train_tokenizer(workdir, corpus, *, vocab_size, model_type):
        asked.append((vocab_size, model_type))
        if model_type not in trained:
            trained[model_type] = load_or_train(
                tmp_path / model_type, corpus, vocab_size=400, model_type=model_type
            )
        return trained[model_type]

    monkeypatch.setattr(data, "load_or_train_tokenizer", load_or_train_tokenizer)
    monkeypatch.setattr(jax, "local_device_count", lambda *args, **kwargs: 3)
    settings = {**train.DATA_DEFAULTS, "dataset": "files", "data_dir": str(multi30k_slice(n=1000))}
    corpus = data.load_corpus(data.CorpusSpec.from_settings(settings), "train")
    line = train_speed.default_pipeline_shapes(corpus)
    max_len = TransformerConfig.preset(train.DEFAULT_PRESET, vocab_size=400).max_len
    batcher = train.load_training_data(tmp_path / "run", settings, max_len, 0, print).batcher
    assert line == (
        f"{batcher.num_shapes} batch shapes (so {batcher.num_shapes} compiled train-step "
        f"programs), padding efficiency {batcher.padding_efficiency():.1%}"
    )
    assert asked[0] == asked[1] == (settings["vocab_size"], settings["tokenizer_type"])
