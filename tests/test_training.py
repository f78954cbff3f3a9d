"""Training math and the Trainer: smoothed loss, schedule, overfitting, non-finite loss stop."""

import dataclasses
import json
import math
import pathlib
import struct
import sys
import threading
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data
from tests.make_tiny_workdir import damage_checkpoint
from transformer import Transformer, TransformerConfig, training
from transformer.checkpoints import checkpoint_steps, restore_params
from transformer.training import (
    MetricsLog,
    NonFiniteLossError,
    TrainConfig,
    Trainer,
    ValidationData,
    create_train_state,
    evaluate_loss,
    label_smoothed_cross_entropy,
    learning_rate_schedule,
    make_eval_step,
    make_optimizer,
    make_train_step,
    read_metrics,
    replicate,
    unreplicate,
    with_data_state,
)


def test_label_smoothed_cross_entropy_matches_the_explicit_distribution():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
    targets = np.array([[4, 2, 6, 0, 0], [1, 3, 5, 2, 0]], np.int32)  # 0 is padding
    eps, vocab = 0.1, 7
    q = np.full((2, 5, vocab), eps / vocab) + (1 - eps) * np.eye(vocab)[targets]
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    real = targets != 0
    expected = -(q * log_p).sum(-1)[real].sum()
    loss_sum, num_tokens = label_smoothed_cross_entropy(jnp.asarray(logits), targets, 0, eps)
    assert int(num_tokens) == 7
    np.testing.assert_allclose(float(loss_sum), expected, rtol=1e-5)
    nll_sum, _ = label_smoothed_cross_entropy(jnp.asarray(logits), targets, 0, 0.0)
    np.testing.assert_allclose(float(nll_sum), -log_p[real, targets[real]].sum(), rtol=1e-5)


def test_padding_positions_do_not_count():
    logits = jnp.zeros((1, 3, 5)).at[0, 2].set(100.0)  # garbage only at a padding position
    loss_sum, n = label_smoothed_cross_entropy(logits, jnp.array([[1, 2, 0]]), 0, 0.1)
    assert int(n) == 2
    np.testing.assert_allclose(float(loss_sum), 2 * math.log(5), rtol=1e-6)


@pytest.mark.parametrize("smoothing", [1.0, 1.5, -0.1])
def test_a_smoothing_outside_zero_to_one_is_an_error(smoothing):
    # 1.5 returned a loss, one that rewards ranking the reference token low.
    logits, targets = jnp.zeros((1, 2, 5)), jnp.array([[1, 2]])
    with pytest.raises(ValueError, match=rf"smoothing must be in \[0, 1\), got {smoothing}"):
        label_smoothed_cross_entropy(logits, targets, 0, smoothing)


def test_learning_rate_schedule_is_the_papers_formula():
    d_model, warmup = 512, 4000
    schedule = learning_rate_schedule(d_model, warmup, scale=2.0)

    def paper(step):
        return 2.0 * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)

    for step in (1, 100, 3999, 4000, 4001, 100_000):
        np.testing.assert_allclose(float(schedule(step - 1)), paper(step), rtol=1e-5)
    rates = [float(schedule(c)) for c in range(0, 8000, 50)]
    assert int(np.argmax(rates)) * 50 + 1 in range(3950, 4051)  # peak at the end of warmup
    unscaled = learning_rate_schedule(d_model, warmup)  # scale 1 unless told
    np.testing.assert_allclose(float(unscaled(4000 - 1)), paper(4000) / 2.0, rtol=1e-5)


def test_cooldown_falls_linearly_to_zero_over_the_last_steps():
    d_model, warmup, total = 256, 100, 1000
    paper = learning_rate_schedule(d_model, warmup)
    cooled = learning_rate_schedule(d_model, warmup, total_steps=total, cooldown=0.2)
    # Unchanged before the last 200 updates, then paper rate x (total - count) / 200.
    for count in (0, 99, 500, 799, 800):
        np.testing.assert_allclose(float(cooled(count)), float(paper(count)), rtol=1e-6)
    for count in (850, 900, 999):
        expected = float(paper(count)) * (total - count) / 200
        np.testing.assert_allclose(float(cooled(count)), expected, rtol=1e-5)
    assert float(cooled(total - 1)) > 0.0  # the last update still moves the weights
    assert float(cooled(total)) == 0.0
    with pytest.raises(ValueError, match="total_steps"):
        learning_rate_schedule(d_model, warmup, cooldown=0.2)


def test_a_cooldown_lasts_at_least_one_update_and_needs_a_run_of_one_or_more():
    # 1% of 10 updates rounds to none: the cooldown is then the last update, whose factor
    # is 1 (as a longer cooldown's last update gets 1/cooldown_steps), and it ends at 0.
    paper = learning_rate_schedule(64, 4)
    short = learning_rate_schedule(64, 4, total_steps=10, cooldown=0.01)
    for count in range(10):
        np.testing.assert_allclose(float(short(count)), float(paper(count)), rtol=1e-6)
    assert float(short(10)) == 0.0
    single = learning_rate_schedule(64, 4, total_steps=1, cooldown=0.2)  # a one-update run
    np.testing.assert_allclose(float(single(0)), float(paper(0)), rtol=1e-6)
    assert float(single(1)) == 0.0
    with pytest.raises(ValueError, match="a cooldown needs total_steps >= 1, got 0"):
        learning_rate_schedule(64, 4, total_steps=0, cooldown=0.2)


def test_sqrt_cooldown_falls_as_one_minus_the_root_of_its_progress():
    d_model, warmup, total = 256, 100, 1000
    paper = learning_rate_schedule(d_model, warmup)
    linear = learning_rate_schedule(d_model, warmup, total_steps=total, cooldown=0.2)
    cooled = learning_rate_schedule(
        d_model, warmup, total_steps=total, cooldown=0.2, cooldown_shape="sqrt"
    )
    for count in (0, 99, 500, 799, 800):  # the same rate as the paper's before the cooldown
        assert float(cooled(count)) == float(linear(count))
    for count in (801, 850, 900, 999):
        progress = 1.0 - (total - count) / 200  # x: the fraction of the cooldown done
        expected = float(paper(count)) * (1.0 - np.sqrt(progress))
        np.testing.assert_allclose(float(cooled(count)), expected, rtol=1e-5)
        assert float(cooled(count)) < float(linear(count))  # below the line all the way down
    assert float(cooled(total - 1)) > 0.0
    assert float(cooled(total)) == 0.0
    with pytest.raises(ValueError, match="cooldown_shape"):
        learning_rate_schedule(
            d_model, warmup, total_steps=total, cooldown=0.2, cooldown_shape="cosine"
        )
    with pytest.raises(ValueError, match="cooldown_shape"):
        TrainConfig(steps=10, cooldown_shape="cosine")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("steps", 0, "steps must be >= 1, got 0"),
        ("epochs", 0, "epochs must be >= 1, got 0"),
        ("warmup_steps", 0, "warmup_steps must be >= 1, got 0"),
        # The step counter is 32 bits: more was a jit's OverflowError traceback, after the
        # tokenizer and the tokenized splits were written into the workdir.
        ("steps", 2**31, "steps must be at most 2,147,483,647, got 2,147,483,648"),
        (
            "warmup_steps",
            10**20,
            "warmup_steps must be at most 2,147,483,647, got 100,000,000,000,000,000,000",
        ),
        ("cooldown", -0.01, "cooldown must be in [0, 1], got -0.01"),
        ("cooldown", 1.01, "cooldown must be in [0, 1], got 1.01"),
        ("learning_rate_scale", 0.0, "learning_rate_scale must be > 0 and finite, got 0.0"),
        ("learning_rate_scale", math.nan, "learning_rate_scale must be > 0 and finite, got nan"),
        ("grad_clip_norm", -1.0, "grad_clip_norm must be > 0 and finite, got -1.0"),
        ("adam_eps", math.inf, "adam_eps must be > 0 and finite, got inf"),
        ("weight_decay", -0.1, "weight_decay must be >= 0 and finite, got -0.1"),
        ("weight_decay", math.nan, "weight_decay must be >= 0 and finite, got nan"),
        ("seed", -1, "seed must be in [0, 2**32), got -1"),
        ("seed", 2**32, "seed must be in [0, 2**32), got 4294967296"),
        ("adam_b1", 1.0, "adam_b1 must be in [0, 1), got 1.0"),
        ("adam_b2", -0.1, "adam_b2 must be in [0, 1), got -0.1"),
        ("label_smoothing", 1.0, "label_smoothing must be in [0, 1), got 1.0"),
        ("log_every", 0, "log_every must be >= 1, got 0"),
        ("checkpoint_every", 0, "checkpoint_every must be >= 1, got 0"),
        ("keep_checkpoints", 0, "keep_checkpoints must be >= 1, got 0"),
        # -1 scored all validation lines but the last (sources[:-1]); 0 scored them all.
        ("bleu_max_sentences", -1, "bleu_max_sentences must be >= 1, got -1"),
        ("bleu_max_sentences", 0, "bleu_max_sentences must be >= 1, got 0"),
        ("bleu_max_tokens", 0, "bleu_max_tokens must be >= 1, got 0"),
        ("eval_every", -1, "eval_every must be >= 0, got -1"),
        ("bleu_every", -1000, "bleu_every must be >= 0, got -1000"),
    ],
)
def test_a_setting_out_of_its_range_is_a_one_line_error_naming_it(field, value, message):
    # A library user builds TrainConfig directly; train.py's flags reach the same checks.
    with pytest.raises(ValueError) as info:
        TrainConfig(**{"steps": 10, field: value})
    assert str(info.value) == message


@pytest.mark.parametrize(
    "field, value",
    [
        ("steps", 1),
        ("epochs", 1),
        ("warmup_steps", 1),
        ("cooldown", 0.0),
        ("cooldown", 1.0),  # the whole run cools down
        ("learning_rate_scale", 1e-30),
        ("grad_clip_norm", None),  # no clipping
        ("weight_decay", 0.0),  # plain Adam
        ("adam_eps", 1e300),
        ("seed", 0),
        ("seed", 2**32 - 1),  # the largest: jax.random.PRNGKey keeps 32 bits
        ("adam_b1", 0.0),
        ("adam_b2", 0.0),
        ("label_smoothing", 0.0),  # no smoothing
        ("log_every", 1),
        ("checkpoint_every", 1),
        ("keep_checkpoints", 1),
    ],
)
def test_the_edges_of_each_settings_range_are_accepted(field, value):
    assert getattr(TrainConfig(**{"steps": None, "epochs": 1, field: value}), field) == value


def test_a_run_of_neither_steps_nor_epochs_is_an_error():
    with pytest.raises(ValueError, match="^give either steps or epochs$"):
        TrainConfig()
    assert TrainConfig(epochs=3).steps is None  # epochs decide


def _metrics_file(workdir, steps):
    log = MetricsLog(workdir)
    for step in steps:
        log.write(step, {"loss": 10.0 / step})
    log.close()
    return workdir / "metrics.jsonl"


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    path = _metrics_file(tmp_path, range(1, 7))
    with path.open("a", encoding="utf-8") as f:
        f.write('{"step": 7, "elapsed_s": 12.3, "lo')  # killed while appending
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
    elapsed_4 = read_metrics(tmp_path)[3]["elapsed_s"]
    log = MetricsLog(tmp_path, resume_step=4)
    log.write(5, {"loss": 1.0})
    log.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[4]["elapsed_s"] >= elapsed_4  # the clock goes on from the kept records
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_metrics_are_kept_without_tensorboardx(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import raises ImportError
    told = []
    log = MetricsLog(tmp_path, log=told.append)
    log.write(1, {"loss": 2.5})
    log.write(2, {"loss": 1.5})
    log.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 2.5), (2, 1.5)]
    assert len(told) == 1 and "tensorboardX is not installed" in told[0]
    assert not list(tmp_path.glob("events.out.tfevents*"))


def test_a_failed_metrics_rewrite_on_resume_loses_no_record(tmp_path, monkeypatch):
    path = _metrics_file(tmp_path, range(1, 9))
    before = path.read_text()
    write_text = pathlib.Path.write_text

    def fail_halfway(self, text, *args, **kwargs):
        write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", fail_halfway)
    with pytest.raises(OSError, match="No space left"):
        MetricsLog(tmp_path, resume_step=4)
    assert path.read_text() == before


def test_optimizer_is_adam_with_the_papers_betas_and_optional_clipping():
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.array([300.0, 400.0, 0.0])}
    plain = make_optimizer(TrainConfig(steps=1, warmup_steps=1), d_model=4)
    clipped = make_optimizer(TrainConfig(steps=1, warmup_steps=1, grad_clip_norm=1.0), d_model=4)
    state = plain.init(params)
    updates, state = plain.update(grads, state, params)
    # First Adam step: m/(sqrt(v)+eps) = sign(g); lr(1) = 4^-0.5 * 1 = 0.5.
    np.testing.assert_allclose(updates["w"], [-0.5, -0.5, 0.0], rtol=1e-6)
    mu = state[0].mu["w"]
    np.testing.assert_allclose(mu, 0.1 * grads["w"], rtol=1e-6)  # b1 = 0.9
    np.testing.assert_allclose(state[0].nu["w"], 0.02 * grads["w"] ** 2, rtol=1e-6)  # b2 = 0.98
    # eps = 1e-9: a gradient of 1e-9 moves by lr * g / (|g| + eps) = half the rate.
    tiny = {"w": jnp.array([1e-9, -1e-9, 0.0])}
    updates, _ = plain.update(tiny, plain.init(params), params)
    np.testing.assert_allclose(updates["w"], [-0.25, 0.25, 0.0], rtol=1e-3)
    _, cstate = clipped.update(grads, clipped.init(params), params)
    # Adam (second in the chain) saw the gradient clipped to norm 1: g / 500.
    np.testing.assert_allclose(cstate[1][0].mu["w"], 0.1 * grads["w"] / 500.0, rtol=1e-6)
    assert TrainConfig(steps=1).label_smoothing == 0.1  # the paper's epsilon_ls


def test_weight_decay_pulls_the_matrices_toward_zero_not_the_vectors():
    # AdamW: the update is -lr * (Adam's direction + weight_decay * weight), for kernels and
    # embeddings only; biases and LayerNorm scales (vectors) get Adam's update alone.
    params = {"kernel": jnp.full((2, 2), 3.0), "bias": jnp.full(2, 3.0)}
    grads = {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}
    config = TrainConfig(steps=1, warmup_steps=1, weight_decay=0.1)
    decayed = make_optimizer(config, d_model=4)
    updates, _ = decayed.update(grads, decayed.init(params), params)
    # lr(1) = 0.5, Adam's first direction sign(g) = 1: -0.5 * (1 + 0.1 * 3).
    np.testing.assert_allclose(updates["kernel"], np.full((2, 2), -0.65), rtol=1e-6)
    np.testing.assert_allclose(updates["bias"], np.full(2, -0.5), rtol=1e-6)
    # With no gradient, only the decay moves the matrix: 0.5 * 0.1 of it per update.
    zero = jax.tree.map(jnp.zeros_like, grads)
    updates, _ = decayed.update(zero, decayed.init(params), params)
    np.testing.assert_allclose(updates["kernel"], np.full((2, 2), -0.15), rtol=1e-6)
    np.testing.assert_allclose(updates["bias"], np.zeros(2), atol=0)
    assert TrainConfig(steps=1).weight_decay == 0.0  # the paper's plain Adam by default


def test_replicate_unreplicate_round_trip():
    tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "s": np.int32(7)}
    replicated = replicate(tree)
    assert replicated["a"].shape == (jax.local_device_count(), 2, 3)
    back = unreplicate(replicated)
    np.testing.assert_array_equal(back["a"], tree["a"])
    assert back["s"] == 7


@pytest.fixture(scope="module")
def tiny_setup(multi30k_dir, tmp_path_factory):
    """16 real Multi30k pairs as ids, a tokenizer trained on 300, a dropout-free tiny model."""
    spec = data.CorpusSpec(data_dir=str(multi30k_dir))
    train = data.load_corpus(spec, "train")
    corpus = data.Corpus(src=train.src[:300], tgt=train.tgt[:300], summary=train.summary)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    tokenizer = data.train_tokenizer(corpus.src + corpus.tgt, path, vocab_size=400)
    few = data.Corpus(src=corpus.src[:16], tgt=corpus.tgt[:16], summary=train.summary)
    encoded = data.encode_corpus(tokenizer, few, max_len=64)
    model_config = TransformerConfig.preset(
        "tiny", vocab_size=tokenizer.vocab_size, dropout_rate=0.0, max_len=64
    )
    return tokenizer, encoded, model_config


def _batcher(tokenizer, encoded):
    return data.TokenBatcher(
        encoded,
        max_tokens=1024,
        num_devices=jax.local_device_count(),
        pad_id=tokenizer.pad_id,
        bos_id=tokenizer.bos_id,
        max_shapes=1,
    )


_RECIPE = dict(warmup_steps=10, learning_rate_scale=0.3, label_smoothing=0.0, bleu_every=0)


def _one_step_setup(tiny_setup, **model_changes):
    """The tiny model (its config with `model_changes`), its optimizer, the state at seed 0
    and one batch."""
    tokenizer, encoded, model_config = tiny_setup
    model = Transformer(model_config.replace(**model_changes))
    optimizer = make_optimizer(TrainConfig(steps=10, **_RECIPE), model_config.d_model)
    state = create_train_state(model, optimizer, seed=0)
    return model, optimizer, state, next(iter(_batcher(tokenizer, encoded)))


def _flat(batch):
    """A batch's src, tgt_in and tgt_out with the device axis merged into the batch's."""
    return (np.concatenate(batch[k]) for k in ("src", "tgt_in", "tgt_out"))


def test_the_step_loss_is_per_real_target_token_and_nll_is_unsmoothed(tiny_setup):
    # Every other test compares runs with runs: a loss divided by source tokens, or an nll
    # with the smoothing in it, passed them all.
    tokenizer = tiny_setup[0]
    model, optimizer, state, batch = _one_step_setup(tiny_setup)
    step = make_train_step(model, optimizer, label_smoothing=0.1, pad_id=tokenizer.pad_id)
    _, metrics = step(replicate(state), batch)
    metrics = {k: float(v) for k, v in unreplicate(metrics).items()}
    src, tgt_in, tgt_out = _flat(batch)
    logits = jax.jit(model.apply)({"params": state.params}, src, tgt_in)
    logits = np.asarray(logits, np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    logp -= logits.max(-1, keepdims=True)
    real = tgt_out != tokenizer.pad_id
    assert real.sum() != (src != tokenizer.pad_id).sum()  # the two counts tell apart
    token_logp = np.take_along_axis(logp, tgt_out[..., None], axis=-1)[..., 0]
    nll = -token_logp[real].sum() / real.sum()
    smoothed = -(0.9 * token_logp + 0.1 * logp.mean(axis=-1))[real].sum() / real.sum()
    assert metrics["num_tokens"] == real.sum()
    assert metrics["nll"] == pytest.approx(nll, rel=1e-5)
    assert metrics["loss"] == pytest.approx(smoothed, rel=1e-5)
    assert abs(smoothed - nll) > 10 * 1e-5 * nll  # the two checks tell them apart
    # The validation figures of the same batch: the same loss and nll (no dropout in either
    # here), and the perplexity of the nll.
    eval_step = make_eval_step(model, label_smoothing=0.1, pad_id=tokenizer.pad_id)
    val = evaluate_loss(eval_step, replicate(state.params), [batch])
    assert val["val_loss"] == pytest.approx(smoothed, rel=1e-5)
    assert val["val_nll"] == pytest.approx(nll, rel=1e-5)
    assert val["val_ppl"] == pytest.approx(math.exp(nll), rel=1e-5)


def test_a_batch_without_the_device_axis_is_an_error_naming_that_axis():
    # A [b, len] batch failed in the model with "src_BS must be token ids [batch, length],
    # got shape (6,): add the batch axis (ids[None])", which names the wrong axis.
    config = TransformerConfig.preset("tiny", vocab_size=20, dropout_rate=0.0)
    model = Transformer(config)
    optimizer = make_optimizer(TrainConfig(steps=10, **_RECIPE), config.d_model)
    state = create_train_state(model, optimizer, seed=0)
    batch = {name: np.ones((4, 6), np.int32) for name in ("src", "tgt_in", "tgt_out")}
    message = r"batch\['src'\] must be \[devices, batch, length\].*TokenBatcher"
    step = make_train_step(model, optimizer, label_smoothing=0.0, pad_id=0)
    with pytest.raises(ValueError, match=message):
        step(replicate(state), batch)
    eval_step = make_eval_step(model, label_smoothing=0.0, pad_id=0)
    with pytest.raises(ValueError, match=message):
        eval_step(replicate(state.params), batch)
    # With the device axis the same batch trains.
    one_device = {name: x[None] for name, x in batch.items()}
    if jax.local_device_count() == 1:
        _, metrics = step(replicate(state), one_device)
        assert float(unreplicate(metrics)["num_tokens"]) == 24


def test_each_step_draws_its_own_dropout_masks(tiny_setup):
    # A key folded with a constant in place of the step passed every test: one mask for
    # the whole run. Same parameters and batch, steps 0 and 1: other masks, other losses.
    tokenizer = tiny_setup[0]
    model, optimizer, state, batch = _one_step_setup(tiny_setup, dropout_rate=0.3)
    step = make_train_step(model, optimizer, label_smoothing=0.0, pad_id=tokenizer.pad_id)
    losses = []
    for at in (0, 0, 1):
        after, metrics = step(replicate(state.replace(step=np.asarray(at, np.int32))), batch)
        losses.append(float(unreplicate(metrics)["loss"]))
        # The step counts itself: a step that left it (or took it back) would draw the
        # masks of the step before, and passed every other test.
        assert int(unreplicate(after.step)) == at + 1
    assert losses[0] == losses[1] != losses[2]


def test_a_step_updates_the_state_in_place_and_padding_alone_changes_nothing(tiny_setup):
    # The state is donated: the step's input buffers are reused for its output, so a
    # run holds one copy of the parameters and Adam's moments, not two. A global batch
    # of padding alone (no target token) is a zero loss and gradient, not 0 / 0 = NaN.
    tokenizer = tiny_setup[0]
    model, optimizer, state, batch = _one_step_setup(tiny_setup)
    empty = {**batch, "tgt_out": np.full_like(batch["tgt_out"], tokenizer.pad_id)}
    step = make_train_step(model, optimizer, label_smoothing=0.1, pad_id=tokenizer.pad_id)
    given = replicate(state)
    after, metrics = step(given, empty)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(given.params))
    metrics = {k: float(v) for k, v in unreplicate(metrics).items()}
    assert metrics == {"loss": 0.0, "nll": 0.0, "num_tokens": 0.0, "grad_norm": 0.0}
    for before, now in zip(
        jax.tree.leaves(state.params), jax.tree.leaves(unreplicate(after.params)), strict=True
    ):
        np.testing.assert_array_equal(now, before)


def test_validation_of_a_model_with_dropout_is_without_it(tiny_setup):
    # An eval step in training mode passed every other test: each model they gave it had
    # no dropout. The validation nll is the dropout-free model's, as the search sees it.
    tokenizer = tiny_setup[0]
    model, _, state, batch = _one_step_setup(tiny_setup, dropout_rate=0.3)
    params = state.params
    eval_step = make_eval_step(model, label_smoothing=0.1, pad_id=tokenizer.pad_id)
    val = evaluate_loss(eval_step, replicate(params), [batch])
    src, tgt_in, tgt_out = _flat(batch)
    logits = jax.jit(model.apply)({"params": params}, src, tgt_in)
    nll_sum, n = label_smoothed_cross_entropy(logits, tgt_out, tokenizer.pad_id, 0.0)
    assert val["val_nll"] == pytest.approx(float(nll_sum) / int(n), rel=1e-5)


def _one_batch_validation(tiny_setup, **fields) -> ValidationData:
    tokenizer, encoded, _ = tiny_setup
    return ValidationData(
        batches=lambda: [next(iter(_batcher(tokenizer, encoded)))], tokenizer=tokenizer, **fields
    )


def test_validation_can_be_turned_off_and_bleu_scored_on_every_line(
    tiny_setup, tmp_path, monkeypatch
):
    # eval_every=0 and bleu_every=0 validate never, though validation data is given; and
    # bleu_max_sentences=None scores every validation line, a number N the first N.
    trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path)
    config = trainer.config
    assert config.bleu_every == 0 and config.bleu_max_sentences is None
    sources = [f"source {i}" for i in range(11)]  # more than a default N would keep
    references = [f"reference {i}" for i in range(11)]
    validation = _one_batch_validation(tiny_setup, sources=sources, references=references)
    trainer.run(with_data_state(batcher), config.steps, validation)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [4, 8]
    assert not any(key.startswith("val_") for r in records for key in r)

    scored = []

    def fake_bleu(model, params, tokenizer, sources, references, *, max_tokens):
        scored.append((list(sources), list(references), max_tokens))
        return 12.5

    monkeypatch.setattr(training, "evaluate_bleu", fake_bleu)
    assert trainer.validate(validation, bleu=True)["val_bleu"] == 12.5
    # Without sentences to translate, a BLEU step measures the loss alone.
    assert "val_bleu" not in trainer.validate(ValidationData(validation.batches), bleu=True)
    # The smallest N and token budget there are.
    trainer.config = dataclasses.replace(config, bleu_max_sentences=1, bleu_max_tokens=1)
    trainer.validate(validation, bleu=True)
    trainer.close()
    assert scored[0] == (sources, references, config.bleu_max_tokens)
    assert scored[1] == (sources[:1], references[:1], 1)


def test_a_tiny_set_can_be_overfit(tiny_setup, tmp_path):
    tokenizer, encoded, model_config = tiny_setup
    config = TrainConfig(steps=100, log_every=10, eval_every=0, checkpoint_every=100, **_RECIPE)
    trainer = Trainer(model_config, config, tmp_path, pad_id=tokenizer.pad_id, progress=False)
    batcher = _batcher(tokenizer, encoded)
    assert trainer.restore_or_init(batcher) == 0
    trainer.open_metrics()
    result = trainer.run(with_data_state(batcher), config.steps)
    trainer.close()
    nll = [m["nll"] for m in read_metrics(tmp_path)]
    assert result.step == 100 and not result.interrupted
    assert nll[0] > 3.5  # about the unigram entropy at the start
    assert nll[-1] < 0.5, nll  # memorized 16 sentences
    assert checkpoint_steps(tmp_path) == [100]


def _eight_step_trainer(tiny_setup, tmp_path, log=None, **changes) -> tuple[Trainer, Any]:
    """A Trainer of 8 steps, logging and saving every 4 (or TrainConfig `changes`), and its
    batcher, ready to run (resumed where `tmp_path` has a checkpoint)."""
    tokenizer, encoded, model_config = tiny_setup
    config = TrainConfig(steps=8, log_every=4, eval_every=0, checkpoint_every=4, **_RECIPE)
    config = dataclasses.replace(config, **changes)
    trainer = Trainer(
        model_config, config, tmp_path, pad_id=tokenizer.pad_id, progress=False, log=log
    )
    batcher = _batcher(tokenizer, encoded)
    trainer.restore_or_init(batcher)
    trainer.open_metrics()
    return trainer, batcher


def test_an_overflowed_gradient_with_a_finite_loss_is_not_saved(tiny_setup, tmp_path):
    # A step whose loss is finite but whose gradient overflowed leaves NaN parameters.
    # Checked by its loss alone, step 8 (a checkpoint step, the last) was saved so.
    trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path)
    train = trainer._train

    def overflowing(state, batch):  # what an inf in the backward pass does at step 8
        state, metrics = train(state, batch)
        if trainer.step == 7:
            state = state.replace(params=jax.tree.map(lambda x: x * np.nan, state.params))
            metrics = {**metrics, "grad_norm": metrics["grad_norm"] * np.inf}
        return state, metrics

    trainer._train = overflowing
    with pytest.raises(NonFiniteLossError) as info:
        trainer.run(with_data_state(batcher), 8)
    trainer.close()
    message = str(info.value)
    assert message.startswith("gradient norm is inf at step 8 (its loss, ")
    assert "stopped without saving this step" in message and "\n" not in message
    assert checkpoint_steps(tmp_path) == [4]
    params, _ = restore_params(tmp_path, "last")
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


def test_non_finite_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(
    tiny_setup, tmp_path
):
    trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path)
    trainer.run(with_data_state(batcher), 4)
    good = unreplicate(trainer.state.params)
    # Poison the parameters: step 5 computes a NaN loss.
    trainer.state = trainer.state.replace(
        params=replicate(jax.tree.map(lambda x: x * np.float32("nan"), good))
    )
    with pytest.raises(NonFiniteLossError, match="at step 5") as info:
        trainer.run(with_data_state(batcher), 8)
    trainer.close()
    assert "\n" not in str(info.value)
    # The advice names the TrainConfig fields a library user sets and train.py's flags.
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for field, flag in [
        ("learning_rate_scale", "--lr-scale"),
        ("warmup_steps", "--warmup-steps"),
        ("grad_clip_norm", "--clip-grad-norm"),
    ]:
        assert field in fields and f"{field} ({flag})" in str(info.value)
    assert checkpoint_steps(tmp_path) == [4]
    params, step = restore_params(tmp_path, "last")
    assert step == 4
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(good), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_resume_past_a_damaged_last_checkpoint_saves_that_step_again(tiny_setup, tmp_path):
    tokenizer, encoded, model_config = tiny_setup
    config = TrainConfig(steps=8, log_every=4, eval_every=0, checkpoint_every=4, **_RECIPE)

    def train(log):
        trainer = Trainer(
            model_config, config, tmp_path, pad_id=tokenizer.pad_id, progress=False, log=log
        )
        batcher = _batcher(tokenizer, encoded)
        start = trainer.restore_or_init(batcher)
        trainer.run(with_data_state(batcher), config.steps)
        trainer.close()
        return start, trainer.params()

    _, straight = train(log=print)
    damage_checkpoint(tmp_path / "checkpoints" / "8")
    lines = []
    start, resumed = train(log=lines.append)
    warnings = [line for line in lines if line.startswith("warning: ")]
    assert start == 4 and len(warnings) == 1 and "step 8" in warnings[0]
    assert "kept as 8.damaged" in warnings[0]
    assert (tmp_path / "checkpoints" / "8.damaged").is_dir()
    # Step 8 trained again from step 4 is on disk as the latest, readable and the same.
    warnings.clear()
    params, step = restore_params(tmp_path, "last", log=warnings.append)
    assert step == 8 and warnings == [] and checkpoint_steps(tmp_path) == [4, 8]
    for a, b, c in zip(*map(jax.tree.leaves, (params, resumed, straight)), strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_a_log_record_holds_the_means_over_its_steps(tiny_setup, tmp_path):
    # One step's loss swings with its batch's sentences; a record averages its window.
    tokenizer, encoded, model_config = tiny_setup
    # 10 steps, not a multiple of log_every: the last two are a record of their own.
    config = TrainConfig(steps=10, log_every=4, eval_every=0, checkpoint_every=10, **_RECIPE)
    trainer = Trainer(model_config, config, tmp_path, pad_id=tokenizer.pad_id, progress=False)
    batcher = data.TokenBatcher(
        encoded,
        max_tokens=256,  # batches of a few sentences, so of different token counts
        num_devices=jax.local_device_count(),
        pad_id=tokenizer.pad_id,
        bos_id=tokenizer.bos_id,
        max_shapes=1,
    )
    trainer.restore_or_init(batcher)
    trainer.open_metrics()
    tokens, losses = [], []

    def counted(batches):
        for batch, state in batches:
            tokens.append(int(np.sum(batch["tgt_out"] != tokenizer.pad_id)))
            yield batch, state

    result = trainer.run(
        counted(with_data_state(batcher)), 10, check_loss=lambda step, loss: losses.append(loss)
    )
    trainer.close()
    assert len(losses) == 10 and len(set(tokens)) > 1
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [4, 8, 10]
    for r, window in zip(records, (slice(0, 4), slice(4, 8), slice(8, 10)), strict=True):
        weighted = np.dot(losses[window], tokens[window]) / sum(tokens[window])
        np.testing.assert_allclose(r["loss"], weighted, rtol=1e-9)
        assert r["loss"] != losses[window][-1]
    assert result.last_loss == records[-1]["loss"]


def test_a_log_window_weighs_losses_by_tokens_and_grad_norms_by_steps():
    from transformer.training import _LogWindow

    window = _LogWindow()
    window.add({"loss": 1.0, "nll": 0.5, "num_tokens": 10, "grad_norm": 1.0})
    window.add({"loss": 3.0, "nll": 2.5, "num_tokens": 30, "grad_norm": 3.0})
    assert window.means() == {"loss": 2.5, "nll": 2.0, "grad_norm": 2.0}
    window.add({"loss": 4.0, "nll": 4.0, "num_tokens": 5, "grad_norm": 0.5})
    assert window.means() == {"loss": 4.0, "nll": 4.0, "grad_norm": 0.5}  # a new window


def test_a_log_window_carried_in_a_checkpoint_gives_the_same_means():
    from transformer.training import _LogWindow

    window = _LogWindow()
    window.add({"loss": 1.5, "nll": 1.0, "num_tokens": 10, "grad_norm": 2.0})
    window.add({"loss": 2.5, "nll": 2.0, "num_tokens": 30, "grad_norm": 4.0})
    restored = _LogWindow(json.loads(json.dumps(window.state())))  # through the meta item
    assert restored.means() == window.means() == {"loss": 2.25, "nll": 1.75, "grad_norm": 3.0}


def _stop_at(step, batches, stop, start=0):
    """Yields `batches` (of a run at `start`), setting `stop` as the batch of `step` comes,
    as a SIGTERM during that step would: the run stops after it."""
    for number, batch in enumerate(batches, start + 1):
        if number == step:
            stop.set()
        yield batch


def test_a_run_stopped_between_two_log_records_resumes_to_the_records_of_one_never_stopped(
    tiny_setup, tmp_path
):
    # A record holds the means over the steps since the last one: the checkpoint of a stop
    # at step 6 carries the sums of steps 5 and 6 into the resumed run's record 8.
    straight, batcher = _eight_step_trainer(tiny_setup, tmp_path / "straight")
    straight.run(with_data_state(batcher), 8)
    straight.close()
    stop = threading.Event()
    trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path / "stopped")
    result = trainer.run(_stop_at(6, with_data_state(batcher), stop), 8, stop_event=stop)
    trainer.close()
    assert result.step == 6 and result.interrupted
    assert checkpoint_steps(tmp_path / "stopped") == [4, 6]
    trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path / "stopped")
    assert trainer.step == 6
    trainer.run(with_data_state(batcher), 8)
    trainer.close()
    fields = ("step", "loss", "nll", "grad_norm", "lr")
    records = [tuple(r[k] for k in fields) for r in read_metrics(tmp_path / "stopped")]
    expected = [tuple(r[k] for k in fields) for r in read_metrics(tmp_path / "straight")]
    assert [r[0] for r in records] == [4, 8] and records == expected
    # The recipe's label_smoothing (0 here) reaches the step: the loss is the nll.
    assert all(loss == nll for _, loss, nll, *_ in records)
    # The stop's checkpoint is gone once a scheduled one follows, as in the run never stopped.
    assert checkpoint_steps(tmp_path / "stopped") == checkpoint_steps(tmp_path / "straight")
    # A record's learning rate is the one its last step's update used: step N's is
    # schedule(N - 1), as the optimizer counts updates from 0.
    schedule = learning_rate_schedule(tiny_setup[2].d_model, 10, scale=0.3)
    for step, *_, lr in records:
        assert lr == pytest.approx(float(schedule(step - 1)), rel=1e-6)


def test_a_checkpoint_where_a_run_ends_off_the_schedule_is_kept_when_it_goes_on(
    tiny_setup, tmp_path
):
    # The end of a run is on the checkpoint schedule: saved as a stop's, it was deleted by
    # the first scheduled save of a run resumed with more steps.
    trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path)
    assert not trainer.run(with_data_state(batcher), 6).interrupted
    trainer.close()
    trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path)
    trainer.run(with_data_state(batcher), 8)
    trainer.close()
    assert checkpoint_steps(tmp_path) == [4, 6, 8]


def test_a_trainer_updates_with_every_optimizer_setting_of_its_config(tiny_setup, tmp_path):
    # The Trainer builds its optimizer from a copy of the config's recipe fields: one left
    # out of the copy (clipping, a cooldown's length) was silently its default.
    tokenizer, _, model_config = tiny_setup
    config = TrainConfig(
        steps=6, warmup_steps=2, learning_rate_scale=2.0, cooldown=0.5, cooldown_shape="sqrt",
        grad_clip_norm=0.5, weight_decay=0.1, adam_b1=0.8, adam_b2=0.9, adam_eps=1e-3,
    )  # fmt: skip
    trainer = Trainer(model_config, config, tmp_path, pad_id=tokenizer.pad_id, progress=False)
    trainer.close()
    expected = make_optimizer(config, model_config.d_model)
    params = {"kernel": jnp.full((2, 2), 3.0), "bias": jnp.full(2, 3.0)}
    state, expected_state = trainer.optimizer.init(params), expected.init(params)
    for step in range(6):  # all 6 updates, the cooldown's 3 among them
        grads = {"kernel": jnp.full((2, 2), step + 1.0), "bias": jnp.full(2, -1.0)}
        updates, state = trainer.optimizer.update(grads, state, params)
        expected_updates, expected_state = expected.update(grads, expected_state, params)
        for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(expected_updates), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_validation_follows_its_own_schedule_and_a_scored_step_is_saved(
    tiny_setup, tmp_path, monkeypatch
):
    # Validation at steps 3 and 6, BLEU at 6: neither is a log or checkpoint step (4, 8).
    monkeypatch.setattr(training, "evaluate_bleu", lambda *args, **kwargs: 7.5)
    lines = []
    trainer, batcher = _eight_step_trainer(
        tiny_setup, tmp_path, lines.append, eval_every=3, bleu_every=6, keep_checkpoints=1
    )
    validation = _one_batch_validation(tiny_setup, sources=["a"], references=["b"])
    result = trainer.run(with_data_state(batcher), 8, validation)
    trainer.close()
    val = [r for r in read_metrics(tmp_path) if "val_loss" in r]
    assert [(r["step"], "val_bleu" in r) for r in val] == [(3, False), (6, True)]
    # The scored step is saved off the schedule and kept as the best beside the last.
    assert checkpoint_steps(tmp_path) == [6, 8]
    assert (result.best_step, result.best_bleu) == (6, 7.5)
    # The log line of a validation shows its record's figures.
    assert f"step 3: val_loss {val[0]['val_loss']:.3f}, val_ppl {val[0]['val_ppl']:.2f}" in lines
    assert (
        f"step 6: val_loss {val[1]['val_loss']:.3f}, val_ppl {val[1]['val_ppl']:.2f}, "
        "val_bleu 7.50" in lines
    )


def test_a_validation_a_stop_skipped_is_run_on_the_next_resume_only(
    tiny_setup, tmp_path, monkeypatch
):
    # BLEU every 4 steps (and no validation loss of its own): the stop at the last step
    # skips the one due there; a resume stopped at once still skips it, the next one runs
    # it and scores the checkpoint with it, and no later resume runs it again.
    monkeypatch.setattr(training, "evaluate_bleu", lambda *args, **kwargs: 7.5)
    validation = _one_batch_validation(tiny_setup, sources=["a"], references=["b"])
    schedule = dict(eval_every=0, bleu_every=4)
    straight, batcher = _eight_step_trainer(tiny_setup, tmp_path / "straight", **schedule)
    straight.run(with_data_state(batcher), 8, validation)
    straight.close()
    workdir, lines = tmp_path / "stopped", []

    def resume(stop_at=None):
        trainer, batcher = _eight_step_trainer(tiny_setup, workdir, lines.append, **schedule)
        stop = threading.Event()
        if stop_at == trainer.step:
            stop.set()
        batches = _stop_at(stop_at, with_data_state(batcher), stop, trainer.step)
        result = trainer.run(batches, 8, validation, stop_event=stop)
        trainer.close()
        validated = [r["step"] for r in read_metrics(workdir) if "val_bleu" in r]
        return result.interrupted, validated, result.best_step

    assert resume(stop_at=8) == (True, [4], 4)
    assert "step 8: validation skipped: stopping" in lines
    assert resume(stop_at=8) == (True, [4], 4)  # stopped before it began
    assert resume() == (False, [4, 8], 8)  # of tied scores the newest is the best
    assert lines[-1].startswith("step 8: val_loss ") and lines[-1].endswith(
        " (skipped by the stop)"
    )
    assert resume() == (False, [4, 8], 8)

    def timeless(records):
        drop = ("elapsed_s", "tokens_per_s")
        return [{k: v for k, v in r.items() if k not in drop} for r in records]

    assert timeless(read_metrics(workdir)) == timeless(read_metrics(tmp_path / "straight"))


def test_a_kill_before_a_made_up_validation_is_marked_leaves_one_record_of_it(
    tiny_setup, tmp_path, monkeypatch
):
    # The resume that runs a validation a stop skipped writes its record, then marks the
    # checkpoint's meta item; killed between the two, the next resume runs it again, and
    # metrics.jsonl still has one record of it.
    monkeypatch.setattr(training, "evaluate_bleu", lambda *args, **kwargs: 7.5)
    validation = _one_batch_validation(tiny_setup, sources=["a"], references=["b"])

    def run(stop_at=None):
        trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path, eval_every=0, bleu_every=4)
        stop = threading.Event()
        batches = _stop_at(stop_at, with_data_state(batcher), stop, trainer.step)
        try:
            return trainer.run(batches, 8, validation, stop_event=stop)
        finally:
            trainer.close()

    run(stop_at=8)

    class Killed(Exception):
        pass

    def killed(*args, **kwargs):
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(training.Checkpoints, "record_meta", killed)
        with pytest.raises(Killed):
            run()
    assert [r["step"] for r in read_metrics(tmp_path) if "val_bleu" in r] == [4, 8]
    assert run().best_step == 8
    # Step 8's training record stays; only its validation record was redone.
    records = [(r["step"], "val_bleu" in r) for r in read_metrics(tmp_path)]
    assert records == [(4, False), (4, True), (8, False), (8, True)]


def _clocked(tiny_setup, monkeypatch):
    """The Trainer's clock made to move 1 s per training batch and 1000 s per validation.

    Returns:
      (timed, validation, tokens): `timed(batches)` yields the batches, moving the clock
      and appending each one's target tokens to `tokens`; `validation` is one batch.
    """
    now = [1000.0]
    monkeypatch.setattr(training, "time", types.SimpleNamespace(time=lambda: now[0]))
    tokenizer, encoded, _ = tiny_setup
    tokens = []

    def timed(batches):
        for batch, state in batches:
            now[0] += 1.0
            tokens.append(int(np.sum(batch["tgt_out"] != tokenizer.pad_id)))
            yield batch, state

    def slow_batches():
        now[0] += 1000.0
        return [next(iter(_batcher(tokenizer, encoded)))]

    return timed, ValidationData(batches=slow_batches), tokens


def test_throughput_counts_the_tokens_of_a_records_steps_over_their_training_time(
    tiny_setup, tmp_path, monkeypatch
):
    # A clock that moves 1 s per batch and 1000 s per validation (every 4 steps; a stop
    # skips the one at 8, which the resume then runs): each record's tokens_per_s is its
    # own 2 steps' target tokens over their 2 s, without any validation's time.
    timed, validation, tokens = _clocked(tiny_setup, monkeypatch)
    schedule = dict(steps=12, log_every=2, eval_every=4)
    trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path, **schedule)
    stop = threading.Event()
    trainer.run(_stop_at(8, timed(with_data_state(batcher)), stop), 12, validation, stop_event=stop)
    trainer.close()
    trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path, **schedule)
    trainer.run(timed(with_data_state(batcher)), 12, validation)
    trainer.close()
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12]
    expected = [sum(tokens[i : i + 2]) / 2 for i in range(0, 12, 2)]
    assert [r["tokens_per_s"] for r in records] == pytest.approx(expected, rel=1e-9)


def test_elapsed_time_goes_on_from_the_last_record_kept_on_resume(tmp_path, monkeypatch):
    # Training time, for curves against time: the gap before the resume is not counted.
    now = [100.0]
    monkeypatch.setattr(training, "time", types.SimpleNamespace(time=lambda: now[0]))
    log = MetricsLog(tmp_path)
    for step in (1, 2):
        now[0] += 10.0
        log.write(step, {"loss": 1.0})
    log.close()
    now[0] += 5000.0  # stopped, then resumed from step 1, its one record kept
    resumed = MetricsLog(tmp_path, resume_step=1)
    now[0] += 3.0
    resumed.write(2, {"loss": 1.0})
    resumed.close()
    now[0] += 5000.0  # and again, from step 2
    resumed = MetricsLog(tmp_path, resume_step=2)
    now[0] += 4.0
    resumed.write(3, {"loss": 1.0})
    resumed.close()
    elapsed = [(r["step"], r["elapsed_s"]) for r in read_metrics(tmp_path)]
    assert elapsed == [(1, 10.0), (2, 13.0), (3, 17.0)]


def test_a_run_that_starts_afresh_drops_the_records_of_one_killed_before_its_first_checkpoint(
    tmp_path,
):
    _metrics_file(tmp_path, range(1, 4))  # logged, then killed before anything was saved
    log = MetricsLog(tmp_path)  # a fresh run: resume_step 0
    log.write(1, {"loss": 2.0})
    log.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 2.0)]


def _tensorboard_scalars(workdir) -> list[tuple[str, int, float]]:
    """(tag, step, value) of each point TensorBoard shows: the event files in name order,
    where a writer's purge mark (a session start at step S) hides the earlier points of
    step S on. Event files are TFRecords: length (8 bytes), its CRC (4), data, its CRC (4)."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    shown = []
    for path in sorted(workdir.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            if event.session_log.status == SessionLog.START:
                shown = [point for point in shown if point[1] < event.step]
            shown += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return shown


def test_tensorboard_shows_the_records_of_metrics_jsonl_after_a_resume(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(1, 7):
        log.write(step, {"loss": 10.0 / step, "lr": step / 100})
    log.close()
    # The two writers of this test start in the same second, which would give their event
    # files one name: the first file is renamed as an earlier second's.
    [first] = tmp_path.glob("events.out.tfevents.*")
    first.rename(tmp_path / "events.out.tfevents.0000000000.first")
    resumed = MetricsLog(tmp_path, resume_step=4)  # steps 5 and 6 are trained again
    for step in (5, 6):
        resumed.write(step, {"loss": 1.0 / step, "lr": step / 100})
    resumed.close()
    expected = [(n, r["step"], r[n]) for r in read_metrics(tmp_path) for n in ("loss", "lr")]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
    shown = sorted(_tensorboard_scalars(tmp_path))
    assert [p[:2] for p in shown] == sorted(p[:2] for p in expected)
    assert [p[2] for p in shown] == pytest.approx([p[2] for p in sorted(expected)], rel=1e-6)


def test_bfloat16_logits_give_the_float32_loss():
    # A library caller may pass a bfloat16 model's logits: the loss is still computed and
    # summed in float32, as documented (bfloat16's logsumexp over the vocabulary and sum
    # over the tokens lose about two digits).
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 16, 400)) * 4, jnp.bfloat16)
    targets = jnp.asarray(rng.integers(1, 400, size=(4, 16)), jnp.int32)
    loss_sum, _ = label_smoothed_cross_entropy(logits, targets, 0, 0.1)
    expected, _ = label_smoothed_cross_entropy(logits.astype(jnp.float32), targets, 0, 0.1)
    assert loss_sum.dtype == jnp.float32
    assert float(loss_sum) == pytest.approx(float(expected), rel=1e-6)


def test_the_logged_gradient_norm_is_the_global_batchs_gradient_norm(tiny_setup):
    # grad_norm (the log's, and the clipping's measure) is the norm of the gradient of the
    # step's mean loss, not of the update Adam makes of it.
    tokenizer = tiny_setup[0]
    model, optimizer, state, batch = _one_step_setup(tiny_setup)
    step = make_train_step(model, optimizer, label_smoothing=0.1, pad_id=tokenizer.pad_id)
    _, metrics = step(replicate(state), batch)
    src, tgt_in, tgt_out = _flat(batch)

    def mean_loss(params):
        logits = model.apply({"params": params}, src, tgt_in)
        loss_sum, n = label_smoothed_cross_entropy(logits, tgt_out, tokenizer.pad_id, 0.1)
        return loss_sum / n

    grads = jax.jit(jax.grad(mean_loss))(state.params)
    norm = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in jax.tree.leaves(grads)))
    assert float(unreplicate(metrics)["grad_norm"]) == pytest.approx(norm, rel=1e-4)


def test_the_validation_loss_is_the_mean_over_the_tokens_of_every_batch(tiny_setup):
    # The validation figures are means over every real target token of the pass, each
    # batch weighed by its tokens: not the last batch's, nor a mean of batch means.
    tokenizer, encoded, model_config = tiny_setup
    model = Transformer(model_config)
    optimizer = make_optimizer(TrainConfig(steps=10, **_RECIPE), model_config.d_model)
    params = replicate(create_train_state(model, optimizer, seed=0).params)
    batcher = data.TokenBatcher(
        encoded,
        max_tokens=256,  # several batches of a few sentences each
        num_devices=jax.local_device_count(),
        pad_id=tokenizer.pad_id,
        bos_id=tokenizer.bos_id,
        max_shapes=1,
    )
    batches = [next(batcher) for _ in range(3)]
    tokens = [int(np.sum(b["tgt_out"] != tokenizer.pad_id)) for b in batches]
    assert len(set(tokens)) == 3  # batches of other weights
    eval_step = make_eval_step(model, label_smoothing=0.1, pad_id=tokenizer.pad_id)
    alone = [evaluate_loss(eval_step, params, [b]) for b in batches]
    val = evaluate_loss(eval_step, params, batches)
    for name in ("val_loss", "val_nll"):
        expected = np.dot([v[name] for v in alone], tokens) / sum(tokens)
        assert val[name] == pytest.approx(expected, rel=1e-6)
    assert val["val_ppl"] == pytest.approx(math.exp(val["val_nll"]), rel=1e-6)


def _sums(loss_sum, nll_sum, num_tokens):
    """An eval step's output for `evaluate_loss`: one device's summed figures."""
    return lambda params, batch: {
        "loss_sum": np.float32(loss_sum),
        "nll_sum": np.float32(nll_sum),
        "num_tokens": np.int32(num_tokens),
    }


def test_a_diverged_or_empty_validation_gives_figures_not_an_error():
    # A diverged model's nll of 1000 nats per token: the perplexity is capped (e^50), not
    # an OverflowError that ends the run; a validation without a target token is zeros.
    val = evaluate_loss(_sums(1000.0, 1000.0, 1), None, [{}])
    assert (val["val_loss"], val["val_nll"]) == (1000.0, 1000.0)
    assert val["val_ppl"] == math.exp(50.0)
    assert evaluate_loss(_sums(0.0, 0.0, 0), None, [{}]) == {
        "val_loss": 0.0, "val_nll": 0.0, "val_ppl": 1.0
    }  # fmt: skip


def test_validation_bleu_scores_greedy_translations_against_the_references(monkeypatch):
    # The BLEU of the run's curve is sacreBLEU's corpus score of greedy translations made
    # with the run's decoding token budget, the references as the one reference stream.
    import sacrebleu

    from transformer import translate

    asked = []
    hypotheses = ["a man rides a horse .", "two dogs play ."]
    references = ["a man rides a brown horse on the beach .", "two dogs play in the snow ."]

    def fake_translate(model, params, tokenizer, sentences, **settings):
        asked.append((list(sentences), settings))
        return hypotheses

    monkeypatch.setattr(translate, "translate", fake_translate)
    score = training.evaluate_bleu(None, None, None, ("s1", "s2"), references, max_tokens=7)
    assert asked == [(["s1", "s2"], {"greedy": True, "max_tokens": 7})]
    assert score == sacrebleu.corpus_bleu(hypotheses, [references]).score
    assert score != sacrebleu.corpus_bleu(references, [hypotheses]).score  # brevity penalty


def test_a_log_of_another_process_writes_and_drops_nothing(tmp_path):
    # Only the first process of a multi-host run keeps metrics.jsonl: the others neither
    # add their (identical) records nor cut the file at their resume step.
    path = _metrics_file(tmp_path, range(1, 5))
    before = path.read_text()
    other = MetricsLog(tmp_path, resume_step=2, enabled=False)
    other.write(3, {"loss": 1.0})
    other.close()
    assert path.read_text() == before
    assert len(list(tmp_path.glob("events.out.tfevents*"))) == 1


def test_a_trainers_cooldown_ends_at_the_total_steps_it_is_given(tiny_setup, tmp_path):
    # total_steps, when given, is the run's end (an epochs run's, or more steps than the
    # config's); an epochs config needs it only for a cooldown, and says so.
    tokenizer, _, model_config = tiny_setup
    config = TrainConfig(steps=8, cooldown=0.5, **_RECIPE)
    trainer = Trainer(model_config, config, tmp_path, pad_id=tokenizer.pad_id, total_steps=12)
    trainer.close()
    expected = learning_rate_schedule(model_config.d_model, 10, 0.3, total_steps=12, cooldown=0.5)
    for count in (0, 5, 7, 8, 11, 12):
        assert float(trainer.schedule(count)) == float(expected(count))
    epochs = TrainConfig(epochs=2, **_RECIPE)
    trainer = Trainer(model_config, epochs, tmp_path, pad_id=tokenizer.pad_id)
    trainer.close()
    assert float(trainer.schedule(3)) == float(
        learning_rate_schedule(model_config.d_model, 10, 0.3)(3)
    )
    with pytest.raises(ValueError, match="^a cooldown needs total_steps"):
        Trainer(model_config, epochs.replace(cooldown=0.1), tmp_path, pad_id=tokenizer.pad_id)


def test_each_record_is_a_line_without_a_bar_and_other_processes_show_neither(
    tiny_setup, tmp_path, capsys
):
    # Without a progress bar (a log file) each record is a line of its figures; a process
    # other than the first prints no bar and no line. No validation data: a run whose
    # validation schedule is due trains without it. The last loss is the smoothed loss.
    lines = []
    schedule = dict(eval_every=2, label_smoothing=0.1)
    trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path / "main", lines.append, **schedule)
    result = trainer.run(with_data_state(batcher), 8)
    trainer.close()
    records = read_metrics(tmp_path / "main")
    assert [r["step"] for r in records] == [4, 8]
    assert not any(key.startswith("val_") for r in records for key in r)
    assert lines == [
        f"step {r['step']}/8: loss {r['loss']:.3f}, lr {r['lr']:.2e}, "
        f"{r['tokens_per_s']:,.0f} target tokens/s"
        for r in records
    ]
    assert result.last_loss == records[-1]["loss"] != records[-1]["nll"]
    assert "8/8" not in capsys.readouterr().err
    tokenizer, encoded, model_config = tiny_setup
    for main, workdir in ((True, tmp_path / "bar"), (False, tmp_path / "other")):
        lines.clear()
        trainer = Trainer(
            model_config, trainer.config, workdir, pad_id=tokenizer.pad_id, log=lines.append,
            is_main_process=main,
        )  # fmt: skip
        batcher = _batcher(tokenizer, encoded)
        trainer.restore_or_init(batcher)
        trainer.run(with_data_state(batcher), 8)
        trainer.close()
        bar = capsys.readouterr().err
        assert lines == [] and ("8/8" in bar) == main
        assert bool(read_metrics(workdir)) == main  # metrics.jsonl is the first process's


def test_a_run_whose_batches_run_out_ends_there_and_saves_that_step(tiny_setup, tmp_path):
    trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path)
    batches = with_data_state(batcher)
    result = trainer.run(iter([next(batches) for _ in range(5)]), 8)
    trainer.close()
    assert (result.step, result.interrupted) == (5, False)
    assert checkpoint_steps(tmp_path) == [4, 5]


def test_a_validation_a_stop_skipped_is_made_up_as_the_resumed_schedules_say(
    tiny_setup, tmp_path, monkeypatch
):
    # The stop at step 4 skips the validation loss due there (BLEU is due at 8 only). The
    # resume makes up the loss, and no BLEU the schedule did not call for; a resume whose
    # schedule no longer calls for a validation at step 4 makes up none.
    monkeypatch.setattr(training, "evaluate_bleu", lambda *args, **kwargs: 7.5)
    validation = _one_batch_validation(tiny_setup, sources=["a"], references=["b"])
    for eval_every, expected in ((4, [(4, False), (8, True)]), (0, [(8, True)])):
        workdir = tmp_path / str(eval_every)
        trainer, batcher = _eight_step_trainer(tiny_setup, workdir, eval_every=4, bleu_every=8)
        stop = threading.Event()
        batches = _stop_at(4, with_data_state(batcher), stop)
        assert trainer.run(batches, 8, validation, stop_event=stop).step == 4
        trainer.close()
        assert not any("val_loss" in r for r in read_metrics(workdir))
        trainer, batcher = _eight_step_trainer(
            tiny_setup, workdir, eval_every=eval_every, bleu_every=8
        )
        trainer.run(with_data_state(batcher), 8, validation)
        trainer.close()
        val = [(r["step"], "val_bleu" in r) for r in read_metrics(workdir) if "val_loss" in r]
        assert val == expected


def test_a_resume_from_a_validated_step_does_not_validate_it_again(tiny_setup, tmp_path):
    # A run ended at step 4 ran the validation due there: resumed to 8, its metrics.jsonl
    # holds one validation record a step, as the run never stopped does.
    validation = _one_batch_validation(tiny_setup)
    for steps in (4, 8):
        trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path, eval_every=4)
        trainer.run(with_data_state(batcher), steps, validation)
        trainer.close()
    assert [r["step"] for r in read_metrics(tmp_path) if "val_loss" in r] == [4, 8]


def test_throughput_after_a_validation_between_two_records_counts_only_the_later_steps(
    tiny_setup, tmp_path, monkeypatch
):
    # Validation at steps 2 and 6, records at 4 and 8: each record's tokens_per_s is the
    # target tokens of the 2 steps after the validation over their 2 s (1 s per batch,
    # 1000 s per validation), not every step's tokens since the last record.
    timed, validation, tokens = _clocked(tiny_setup, monkeypatch)
    trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path, eval_every=2)
    trainer.run(timed(with_data_state(batcher)), 8, validation)
    trainer.close()
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in records] == [4, 8]
    expected = [sum(tokens[2:4]) / 2, sum(tokens[6:8]) / 2]
    assert [r["tokens_per_s"] for r in records] == pytest.approx(expected, rel=1e-9)
