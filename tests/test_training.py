"""Training math and the Trainer: smoothed loss, schedule, overfitting, non-finite loss stop."""

import dataclasses
import json
import math
import pathlib
import sys
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


def test_the_step_loss_is_per_real_target_token_and_nll_is_unsmoothed(tiny_setup):
    # Every other test compares runs with runs: a loss divided by source tokens, or an nll
    # with the smoothing in it, passed them all.
    tokenizer, encoded, model_config = tiny_setup
    model = Transformer(model_config)
    recipe = TrainConfig(steps=10, **{**_RECIPE, "label_smoothing": 0.1})
    optimizer = make_optimizer(recipe, model_config.d_model)
    state = create_train_state(model, optimizer, seed=0)
    batch = next(iter(_batcher(tokenizer, encoded)))
    step = make_train_step(model, optimizer, label_smoothing=0.1, pad_id=tokenizer.pad_id)
    _, metrics = step(replicate(state), batch)
    metrics = {k: float(v) for k, v in unreplicate(metrics).items()}
    src, tgt_in, tgt_out = (np.concatenate(batch[k]) for k in ("src", "tgt_in", "tgt_out"))
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
    tokenizer, encoded, model_config = tiny_setup
    model = Transformer(model_config.replace(dropout_rate=0.3))
    optimizer = make_optimizer(TrainConfig(steps=10, **_RECIPE), model_config.d_model)
    state = create_train_state(model, optimizer, seed=0)
    batch = next(iter(_batcher(tokenizer, encoded)))
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
    tokenizer, encoded, model_config = tiny_setup
    model = Transformer(model_config)
    optimizer = make_optimizer(TrainConfig(steps=10, **_RECIPE), model_config.d_model)
    state = create_train_state(model, optimizer, seed=0)
    batch = next(iter(_batcher(tokenizer, encoded)))
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
    tokenizer, encoded, model_config = tiny_setup
    model = Transformer(model_config.replace(dropout_rate=0.3))
    optimizer = make_optimizer(TrainConfig(steps=10, **_RECIPE), model_config.d_model)
    params = create_train_state(model, optimizer, seed=0).params
    batch = next(iter(_batcher(tokenizer, encoded)))
    eval_step = make_eval_step(model, label_smoothing=0.1, pad_id=tokenizer.pad_id)
    val = evaluate_loss(eval_step, replicate(params), [batch])
    src, tgt_in, tgt_out = (np.concatenate(batch[k]) for k in ("src", "tgt_in", "tgt_out"))
    logits = jax.jit(model.apply)({"params": params}, src, tgt_in)
    nll_sum, n = label_smoothed_cross_entropy(logits, tgt_out, tokenizer.pad_id, 0.0)
    assert val["val_nll"] == pytest.approx(float(nll_sum) / int(n), rel=1e-5)


def test_validation_can_be_turned_off_and_bleu_scored_on_every_line(
    tiny_setup, tmp_path, monkeypatch
):
    # eval_every=0 and bleu_every=0 validate never, though validation data is given; and
    # bleu_max_sentences=None scores every validation line, a number N the first N.
    tokenizer, encoded, _ = tiny_setup
    trainer, batcher = _eight_step_trainer(tiny_setup, tmp_path)
    config = trainer.config
    assert config.bleu_every == 0 and config.bleu_max_sentences is None
    sources = [f"source {i}" for i in range(11)]  # more than a default N would keep
    references = [f"reference {i}" for i in range(11)]
    validation = ValidationData(
        batches=lambda: [next(iter(_batcher(tokenizer, encoded)))],
        sources=sources,
        references=references,
        tokenizer=tokenizer,
    )
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


def _eight_step_trainer(tiny_setup, tmp_path) -> tuple[Trainer, Any]:
    """A Trainer of 8 steps, logging and saving every 4, and its batcher, ready to run."""
    tokenizer, encoded, model_config = tiny_setup
    config = TrainConfig(steps=8, log_every=4, eval_every=0, checkpoint_every=4, **_RECIPE)
    trainer = Trainer(model_config, config, tmp_path, pad_id=tokenizer.pad_id, progress=False)
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
