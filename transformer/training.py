"""Training math and the data-parallel training loop (Optax, `jax.pmap`, Orbax checkpoints).

The paper's recipe (section 5.3, 5.4) is the default: Adam with b1 0.9, b2 0.98,
eps 1e-9; the learning rate d_model^-0.5 * min(step^-0.5, step * warmup^-1.5);
label smoothing 0.1; dropout as the model config says.

Data parallelism: parameters and optimizer state are replicated on every local
device, each batch arrives as [devices, batch, len] and `pmap` gives each device
its slice. Each device sums its token losses; `psum` of the loss sums and of
the real-token counts makes the loss (and so the gradient) the mean over all
real target tokens of the global batch, however it is split across devices.
With dropout off, 1, 2 or 4 devices therefore compute the same losses and
gradients up to float rounding, and plain SGD trains the same parameters
(tests/test_pmap_equivalence.py). Adam's tiny eps turns the rounding noise of a
gradient that is zero in exact arithmetic into updates as large as the learning
rate: the attention key biases, which softmax ignores (they add the same q.b_k to
every key's score), then differ between device counts without changing any
output. With dropout on the runs differ, because each device draws its own masks
(its key is folded with its index).

The loop is split into parts a test can call: `create_train_state`,
`make_train_step`, `make_eval_step`, `evaluate_loss`, `evaluate_bleu`,
`MetricsLog` and `Trainer` (`Trainer.restore_or_init`, `Trainer.run`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from transformer.checkpoints import METRICS_FILE, CheckpointError, Checkpoints, metrics_records
from transformer.config import TransformerConfig
from transformer.model import Transformer

PyTree = Any
Batch = dict[str, np.ndarray]
# A batch's arrays, and a batch layout: their shapes in this order, which pick its program.
BATCH_KEYS = ("src", "tgt_in", "tgt_out")
Layout = tuple[tuple[int, ...], ...]


def batch_layout(batch: Batch) -> Layout:
    """The shapes of a batch's src, tgt_in and tgt_out: one compiled step program each."""
    return tuple(tuple(batch[name].shape) for name in BATCH_KEYS)


# Name of the pmapped device axis.
AXIS = "devices"


COOLDOWN_SHAPES = ("linear", "sqrt")


class NonFiniteLossError(Exception):
    """The training loss, or the gradient's norm, became NaN or infinite; str() is a
    one-line message."""


_NON_FINITE_ADVICE = (
    "stopped without saving this step (lower learning_rate_scale (--lr-scale), raise "
    "warmup_steps (--warmup-steps) or set grad_clip_norm (--clip-grad-norm), then resume "
    "from the last checkpoint)"
)


MAX_STEPS = 2**31 - 1  # the step counter is a 32-bit integer in the compiled step


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How to train (everything except the model and the data).

    Attributes:
      steps: optimizer updates to run in total; when None, `epochs` decides.
      epochs: passes over the training data (used when `steps` is None).
      warmup_steps: the paper's warmup (4000 for WMT).
      learning_rate_scale: factor on the paper's learning rate.
      cooldown: fraction of the total steps, at the end, over which the
        learning rate falls to zero; 0 keeps the paper's schedule.
      cooldown_shape: how it falls: "linear" (factor 1 - x at a fraction x of
        the cooldown) or "sqrt" (1 - sqrt(x): a quicker drop, then a longer
        stretch at a low rate).
      label_smoothing: epsilon_ls; the target distribution puts 1 - eps on the
        reference token and eps spread uniformly over the whole vocabulary.
      grad_clip_norm: clip the global gradient norm to this; None disables.
      weight_decay: decoupled weight decay (AdamW, Loshchilov & Hutter 2019): each
        update also subtracts learning rate * weight_decay * the parameter, for the
        matrices (kernels, embeddings), not the biases or LayerNorm scales; 0 is the
        paper's plain Adam.
      adam_b1: Adam beta1.
      adam_b2: Adam beta2.
      adam_eps: Adam epsilon.
      seed: parameter init, dropout and data shuffling.
      log_every: steps between metric lines (metrics.jsonl, TensorBoard, bar).
      eval_every: steps between validation losses; 0 disables.
      bleu_every: steps between validation BLEU scores (greedy decoding); 0 disables.
      bleu_max_tokens: tokens per decoding batch for the BLEU translation.
      bleu_max_sentences: score only the first N validation sentences; None for all.
      checkpoint_every: steps between checkpoints (one is also written at the
        end, at every BLEU evaluation, and on SIGINT/SIGTERM).
      keep_checkpoints: most recent checkpoints kept (plus the best by BLEU).
    """

    steps: int | None = None
    epochs: int | None = None
    warmup_steps: int = 4000
    learning_rate_scale: float = 1.0
    cooldown: float = 0.0
    cooldown_shape: str = "linear"
    label_smoothing: float = 0.1
    grad_clip_norm: float | None = None
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.98
    adam_eps: float = 1e-9
    seed: int = 0
    log_every: int = 100
    eval_every: int = 1000
    bleu_every: int = 5000
    bleu_max_tokens: int = 4096
    bleu_max_sentences: int | None = None
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3

    def __post_init__(self):
        if self.steps is None and self.epochs is None:
            raise ValueError("give either steps or epochs")
        for name in ("steps", "epochs", "warmup_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
            if value is not None and value > MAX_STEPS:
                raise ValueError(f"{name} must be at most {MAX_STEPS:,}, got {value:,}")
        if not 0.0 <= self.cooldown <= 1.0:
            raise ValueError(f"cooldown must be in [0, 1], got {self.cooldown}")
        if self.cooldown_shape not in COOLDOWN_SHAPES:
            raise ValueError(
                f"cooldown_shape must be one of {', '.join(COOLDOWN_SHAPES)}, "
                f"got {self.cooldown_shape!r}"
            )
        for name in ("learning_rate_scale", "grad_clip_norm", "adam_eps"):
            value = getattr(self, name)
            if value is not None and not (0 < value < math.inf):  # NaN fails too
                raise ValueError(f"{name} must be > 0 and finite, got {value}")
        if not 0.0 <= self.weight_decay < math.inf:  # NaN fails too
            raise ValueError(f"weight_decay must be >= 0 and finite, got {self.weight_decay}")
        if not 0 <= self.seed < 2**32:  # jax.random.PRNGKey's 32 bits: 2**32 would be 0 again
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        for name in ("adam_b1", "adam_b2", "label_smoothing"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("log_every", "checkpoint_every", "keep_checkpoints", "bleu_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "bleu_every"):  # 0 turns it off
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.bleu_max_sentences is not None and self.bleu_max_sentences < 1:
            raise ValueError(f"bleu_max_sentences must be >= 1, got {self.bleu_max_sentences}")

    def replace(self, **changes: Any) -> TrainConfig:
        """Returns a copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Inverse of `to_dict`."""
        return cls(**d)


# ----------------------------------------------------------------------------- the recipe


def learning_rate_schedule(
    d_model: int,
    warmup_steps: int,
    scale: float = 1.0,
    *,
    total_steps: int | None = None,
    cooldown: float = 0.0,
    cooldown_shape: str = "linear",
) -> optax.Schedule:
    """The paper's learning rate (section 5.3), as an Optax schedule, with an optional cooldown.

    lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5): a
    linear rise over `warmup_steps`, then decay with the inverse square root of
    the step. `step` counts updates from 1; Optax passes the number of updates
    already done (0 for the first), so the schedule evaluates the formula at
    count + 1 and never divides by zero.

    With `cooldown` > 0 the rate is also multiplied by a factor that falls
    from 1 to 0 over the last `cooldown * total_steps` updates (the last
    update still gets a small positive rate): 1 - x at a fraction x of the
    cooldown ("linear"), or 1 - sqrt(x) ("sqrt", the "1-sqrt" cooldown of
    Hagele et al., 2024). A run of fixed length then ends at a low rate
    instead of the inverse square root's.

    Args:
      d_model: the model width.
      warmup_steps: steps of linear warmup.
      scale: a factor on the whole formula.
      total_steps: updates in the whole run (needed with a cooldown).
      cooldown: fraction of `total_steps`, at the end, of decay to 0.
      cooldown_shape: "linear" or "sqrt" (see above).

    Returns:
      A function from the update count (0-based) to the learning rate.
    """
    if cooldown_shape not in COOLDOWN_SHAPES:
        raise ValueError(f"cooldown_shape must be one of {COOLDOWN_SHAPES}, got {cooldown_shape!r}")
    cooldown_steps = 0
    if cooldown > 0.0:
        if total_steps is None or total_steps < 1:
            raise ValueError(f"a cooldown needs total_steps >= 1, got {total_steps}")
        cooldown_steps = max(1, round(cooldown * total_steps))

    def schedule(count: jax.Array | int) -> jax.Array:
        step = jnp.asarray(count, jnp.float32) + 1.0
        rate = (
            scale * d_model**-0.5 * jnp.minimum(lax.rsqrt(step), step * float(warmup_steps) ** -1.5)
        )
        if cooldown_steps:
            remaining = total_steps + 1.0 - step  # updates left, this one included
            left = jnp.clip(remaining / cooldown_steps, 0.0, 1.0)  # 1 - x
            rate = rate * (left if cooldown_shape == "linear" else 1.0 - jnp.sqrt(1.0 - left))
        return rate

    return schedule


def _config_schedule(config: TrainConfig, d_model: int) -> optax.Schedule:
    """The schedule `config` describes; a cooldown ends at `config.steps`."""
    return learning_rate_schedule(
        d_model,
        config.warmup_steps,
        config.learning_rate_scale,
        total_steps=config.steps,
        cooldown=config.cooldown,
        cooldown_shape=config.cooldown_shape,
    )


def make_optimizer(config: TrainConfig, d_model: int) -> optax.GradientTransformation:
    """Adam with the paper's schedule (AdamW where weight_decay > 0), after optional
    global-norm gradient clipping.

    Args:
      config: uses the Adam hyperparameters, the schedule (its cooldown needs
        `config.steps`), weight_decay and grad_clip_norm.
      d_model: the model width (for the schedule).

    Returns:
      The Optax transformation.
    """
    schedule = _config_schedule(config, d_model)
    betas = dict(b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)
    if config.weight_decay > 0:
        adam = optax.adamw(schedule, **betas, weight_decay=config.weight_decay, mask=_matrices)
    else:
        adam = optax.adam(schedule, **betas)
    if config.grad_clip_norm is None:
        return adam
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adam)


def _matrices(params: PyTree) -> PyTree:
    """True for the parameters weight decay applies to: kernels and embeddings, not the
    biases and LayerNorm scales (vectors), as in AdamW's common use."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def _other_optimizer_forms(
    config: TrainConfig, d_model: int, params: PyTree, opt_state: optax.OptState
) -> list[tuple[optax.OptState, Callable[[optax.OptState], optax.OptState]]]:
    """The `make_optimizer` states of the other grad_clip_norm and weight_decay settings
    (on or off), each with the function that turns it into `opt_state`'s form.

    Clipping and weight decay are stateless: each only adds a place holder to the state,
    so a run can turn either on when it resumes (as the advice after a non-finite loss
    says for clipping) or off, and keep Adam's moments and the schedule's count.
    """
    here = (config.grad_clip_norm is not None, config.weight_decay > 0)
    forms = []
    for clipping in (False, True):
        for decaying in (False, True):
            if (clipping, decaying) == here:
                continue
            other = config.replace(
                grad_clip_norm=1.0 if clipping else None, weight_decay=0.1 if decaying else 0.0
            )
            # Its shapes and dtypes only: no second optimizer state is allocated.
            template = jax.eval_shape(make_optimizer(other, d_model).init, params)
            forms.append((template, functools.partial(_carry_adam, opt_state, here[0], clipping)))
    return forms


def _carry_adam(
    into: optax.OptState, into_clipping: bool, from_clipping: bool, restored: optax.OptState
) -> optax.OptState:
    """`into` with Adam's state and the schedule's count taken from `restored`.

    Either is (clip's state, the rest) with clipping, the rest alone without; the rest
    is (Adam's state, [weight decay's place holder,] the schedule's state).
    """
    source = restored[1] if from_clipping else restored
    target = into[1] if into_clipping else into
    carried = (source[0], *target[1:-1], source[-1])
    return (into[0], carried) if into_clipping else carried


def label_smoothed_cross_entropy(
    logits_BTV: jax.Array, targets_BT: jax.Array, pad_id: int, smoothing: float
) -> tuple[jax.Array, jax.Array]:
    """Summed label-smoothed cross-entropy over the real (non-padding) target tokens.

    The smoothed target distribution is q = (1 - smoothing) * onehot(y) +
    smoothing * uniform(V): the reference token gets 1 - smoothing +
    smoothing / V and every other token smoothing / V. Then

      H(q, p) = logsumexp(z) - (1 - smoothing) * z_y - smoothing * mean(z),

    computed from the logits z without a [batch, len, vocab] one-hot array.
    With smoothing 0 it is the negative log-likelihood.

    Args:
      logits_BTV: float logits [batch, tgt_len, vocab].
      targets_BT: int reference ids [batch, tgt_len]; `pad_id` marks padding.
      pad_id: the padding id (from the tokenizer).
      smoothing: epsilon_ls in [0, 1).

    Returns:
      (loss_sum, num_tokens): float32 scalar sum of the per-token losses over
      real tokens, and the int32 number of real tokens.

    Raises:
      ValueError: `smoothing` is a Python number outside [0, 1).
    """
    if isinstance(smoothing, int | float) and not 0.0 <= smoothing < 1.0:
        # 1.5 gave a loss that rewards the model for ranking the reference low.
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
    logits_BTV = logits_BTV.astype(jnp.float32)
    log_normalizer_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    mean_logit_BT = jnp.mean(logits_BTV, axis=-1)
    loss_BT = log_normalizer_BT - (1.0 - smoothing) * target_logit_BT - smoothing * mean_logit_BT
    real_BT = targets_BT != pad_id
    return jnp.sum(jnp.where(real_BT, loss_BT, 0.0)), jnp.sum(real_BT, dtype=jnp.int32)


# ----------------------------------------------------------------------------- state and steps


@flax.struct.dataclass
class TrainState:
    """Everything that changes during training.

    Attributes:
      step: int32 scalar, optimizer updates done.
      params: float32 parameter pytree.
      opt_state: the optimizer state.
      rng: uint32[2] base key; the dropout key of update `step` on device `d`
        is fold_in(fold_in(rng, step), d), so a resumed run draws the same masks.
    """

    step: jax.Array
    params: PyTree
    opt_state: optax.OptState
    rng: jax.Array


def seed_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """The two independent keys of a run's seed: (parameter init, dropout)."""
    init_key, dropout_key = jax.random.split(jax.random.PRNGKey(seed))
    return init_key, dropout_key


def create_train_state(
    model: Transformer, optimizer: optax.GradientTransformation, seed: int
) -> TrainState:
    """Initializes parameters and optimizer state on the host (unreplicated).

    Args:
      model: the Transformer.
      optimizer: from `make_optimizer`.
      seed: the run's seed; parameters and dropout get independent keys from it.

    Returns:
      The state at step 0, as host numpy arrays.
    """
    init_key, dropout_key = seed_keys(seed)
    tokens_BL = jnp.ones((1, 2), jnp.int32)
    params = _jitted_init(model)(init_key, tokens_BL, tokens_BL)["params"]
    state = TrainState(
        step=np.zeros((), np.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=dropout_key,
    )
    return jax.device_get(state)


@functools.lru_cache(maxsize=8)
def _jitted_init(model: Transformer) -> Callable[..., PyTree]:
    # Modules compare by config, so runs of one model in a process compile init once.
    return jax.jit(model.init)


def replicate(tree: PyTree, devices: Sequence[jax.Device] | None = None) -> PyTree:
    """Copies a host pytree onto every local device, with a leading device axis.

    The arrays get the sharding that the pmapped steps return (a mesh over the
    devices with axis `AXIS`), so the first step's output does not have a new
    input signature that would compile the step a second time.

    Args:
      tree: host arrays.
      devices: where to copy; default all local devices.

    Returns:
      The replicated pytree, each leaf [len(devices), *shape].
    """
    devices = list(devices or jax.local_devices())
    sharding = NamedSharding(Mesh(np.array(devices), (AXIS,)), PartitionSpec(AXIS))
    return jax.tree.map(
        lambda x: jax.device_put(np.broadcast_to(x, (len(devices), *np.shape(x))), sharding),
        tree,
    )


def unreplicate(tree: PyTree) -> PyTree:
    """One device's copy of a replicated pytree, as host numpy.

    Reads one addressable shard rather than indexing `x[0]`, which is slow for
    arrays that `pmap` returns in recent JAX.
    """

    def first(x):
        if isinstance(x, jax.Array) and x.ndim > 0:
            shard = x.addressable_shards[0].data
            return np.asarray(shard)[0] if shard.ndim == x.ndim else np.asarray(shard)
        return np.asarray(x)

    return jax.tree.map(first, tree)


def _checking_the_device_axis(pmapped: Callable) -> Callable:
    """`pmapped(first, batch)`, first raising a ValueError if the batch lacks its device axis.

    pmap takes a [b, len] batch's first axis as the devices': with b devices each
    got [len] and the model's error said to add a batch axis; else pmap's said
    nothing of the batch. `.lower` (ahead-of-time compilation) is pmapped's own.
    """

    def call(first: PyTree, batch: Batch):
        for name in BATCH_KEYS:
            if name in batch and np.ndim(batch[name]) != 3:
                raise ValueError(
                    f"batch[{name!r}] must be [devices, batch, length], got shape "
                    f"{np.shape(batch[name])}: shard it as data.TokenBatcher(..., "
                    "num_devices=jax.local_device_count()) does (or x[None] on one device)"
                )
        return pmapped(first, batch)

    call.lower = pmapped.lower
    return call


def make_train_step(
    model: Transformer,
    optimizer: optax.GradientTransformation,
    *,
    label_smoothing: float,
    pad_id: int,
    devices: Sequence[jax.Device] | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds the pmapped training step.

    Args:
      model: the Transformer (dropout from its config).
      optimizer: from `make_optimizer`.
      label_smoothing: epsilon_ls.
      pad_id: the padding id.
      devices: the devices to run on; default all local devices (all devices
        of all hosts in a multi-host run).

    Returns:
      step(state, batch) -> (state, metrics). `state` is replicated (leading
      device axis) and donated; batch is dict(src [D, b, S], tgt_in [D, b, T],
      tgt_out [D, b, T]). metrics (replicated scalars): "loss" (smoothed, mean
      per real target token of the global batch), "nll" (same, unsmoothed),
      "num_tokens" (real target tokens in the global batch), "grad_norm".
    """

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        num_tokens = lax.psum(jnp.sum(batch["tgt_out"] != pad_id, dtype=jnp.int32), AXIS)
        denominator = jnp.maximum(num_tokens, 1).astype(jnp.float32)
        dropout_key = jax.random.fold_in(
            jax.random.fold_in(state.rng, state.step), lax.axis_index(AXIS)
        )

        def loss_fn(params):
            logits_BTV = model.apply(
                {"params": params},
                batch["src"],
                batch["tgt_in"],
                train=True,
                rngs={"dropout": dropout_key},
            )
            loss_sum, _ = label_smoothed_cross_entropy(
                logits_BTV, batch["tgt_out"], pad_id, label_smoothing
            )
            nll_sum, _ = label_smoothed_cross_entropy(
                lax.stop_gradient(logits_BTV), batch["tgt_out"], pad_id, 0.0
            )
            # This device's share of the global mean; psum of the gradients completes it.
            return loss_sum / denominator, nll_sum / denominator

        (loss, nll), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        grads = lax.psum(grads, AXIS)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        new_state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
        )
        metrics = {
            "loss": lax.psum(loss, AXIS),
            "nll": lax.psum(nll, AXIS),
            "num_tokens": num_tokens,
            "grad_norm": optax.tree.norm(grads),
        }
        return new_state, metrics

    return _checking_the_device_axis(
        jax.pmap(step, axis_name=AXIS, donate_argnums=(0,), devices=devices)
    )


@functools.cache
def _stop_vote() -> Callable[[np.ndarray], jax.Array]:
    """pmapped sum of every device's stop flag ([local devices] int32 in, global sum out)."""
    return jax.pmap(lambda flag: lax.psum(flag, AXIS), axis_name=AXIS)


def make_eval_step(
    model: Transformer,
    *,
    label_smoothing: float,
    pad_id: int,
    devices: Sequence[jax.Device] | None = None,
) -> Callable[[PyTree, Batch], dict[str, jax.Array]]:
    """Builds the pmapped evaluation step (no dropout, no update).

    Args:
      model: the Transformer.
      label_smoothing: epsilon_ls, so that the validation loss compares with
        the training loss.
      pad_id: the padding id.
      devices: as in `make_train_step`.

    Returns:
      eval(params, batch) -> dict(loss_sum, nll_sum, num_tokens), summed over
      the global batch and replicated; `params` replicated.
    """

    def evaluate(params: PyTree, batch: Batch) -> dict[str, jax.Array]:
        logits_BTV = model.apply({"params": params}, batch["src"], batch["tgt_in"], train=False)
        loss_sum, num_tokens = label_smoothed_cross_entropy(
            logits_BTV, batch["tgt_out"], pad_id, label_smoothing
        )
        nll_sum, _ = label_smoothed_cross_entropy(logits_BTV, batch["tgt_out"], pad_id, 0.0)
        sums = {"loss_sum": loss_sum, "nll_sum": nll_sum, "num_tokens": num_tokens}
        return lax.psum(sums, AXIS)

    return _checking_the_device_axis(jax.pmap(evaluate, axis_name=AXIS, devices=devices))


def evaluate_loss(
    eval_step: Callable[[PyTree, Batch], dict[str, jax.Array]],
    params_replicated: PyTree,
    batches: Iterable[Batch],
) -> dict[str, float]:
    """Mean validation losses over every real target token of `batches`.

    Args:
      eval_step: from `make_eval_step`.
      params_replicated: replicated parameters.
      batches: one pass over the validation data, [D, b, L] batches.

    Returns:
      dict(val_loss (label-smoothed, as in training), val_nll, val_ppl = exp(val_nll)).
    """
    totals = {"loss_sum": 0.0, "nll_sum": 0.0, "num_tokens": 0}
    pending = [eval_step(params_replicated, batch) for batch in batches]
    for sums in pending:
        for name, value in unreplicate(sums).items():
            totals[name] += value.item()
    n = max(totals["num_tokens"], 1)
    nll = totals["nll_sum"] / n
    return {
        "val_loss": totals["loss_sum"] / n,
        "val_nll": nll,
        "val_ppl": math.exp(min(nll, 50.0)),
    }


def evaluate_bleu(
    model: Transformer,
    params: PyTree,
    tokenizer: Any,
    sources: Sequence[str],
    references: Sequence[str],
    *,
    max_tokens: int = 4096,
) -> float:
    """Corpus sacreBLEU of greedy translations against the raw references.

    Args:
      model: the Transformer.
      params: unreplicated parameters.
      tokenizer: the run's `data.Tokenizer`.
      sources: normalized source sentences (`data.normalize`).
      references: the raw reference lines, aligned with `sources`.
      max_tokens: tokens per decoding batch.

    Returns:
      The BLEU score (0-100).
    """
    import sacrebleu

    from transformer.translate import translate

    hypotheses = translate(
        model, params, tokenizer, list(sources), greedy=True, max_tokens=max_tokens
    )
    return float(sacrebleu.corpus_bleu(hypotheses, [list(references)]).score)


# ----------------------------------------------------------------------------- logging


class MetricsLog:
    """Appends metric records to workdir/metrics.jsonl and TensorBoard event files.

    Args:
      workdir: the run directory.
      resume_step: on resume, records after this step (written after the last
        checkpoint by the interrupted run, and about to be redone) are dropped,
        and so are lines that are not a record (the torn last line of a run
        killed while writing it).
      enabled: False on every process but the first of a multi-host run.
      log: prints one line; told once when tensorboardX is not installed, in
        which case the records go to metrics.jsonl only.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        resume_step: int = 0,
        enabled: bool = True,
        log: Callable[[str], None] = print,
    ):
        self.path = Path(workdir) / METRICS_FILE
        self.enabled = enabled
        self._writer = None
        # Training time carries over a resume, so curves against time stay continuous.
        self._clock_start, self._clock_offset = time.time(), 0.0
        if not enabled:
            return
        if self.path.exists():
            kept = truncate_metrics(self.path, resume_step)
            if kept:
                self._clock_offset = float(kept[-1].get("elapsed_s", 0.0))
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            # A declared dependency, but an environment made by hand (a GPU image, say) may
            # lack it: the run's own record, metrics.jsonl, needs nothing beyond Python.
            log(
                "warning: tensorboardX is not installed (pip install tensorboardX), so this "
                "run writes no TensorBoard events; metrics.jsonl has every record"
            )
            return
        self._writer = SummaryWriter(
            str(workdir), purge_step=resume_step + 1 if resume_step else None
        )

    def write(self, step: int, values: dict[str, float]) -> None:
        """Writes one record {"step": step, "elapsed_s": seconds of training so far, **values}.

        `elapsed_s` counts wall time since the run started, summed over resumed
        runs (the gap between an interruption and its resume is not counted).
        """
        if not self.enabled:
            return
        elapsed = self._clock_offset + time.time() - self._clock_start
        record = {
            "step": int(step),
            "elapsed_s": round(elapsed, 3),
            **{k: float(v) for k, v in values.items()},
        }
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is None:
            return
        for name, value in values.items():
            self._writer.add_scalar(name, float(value), int(step))

    def drop_validation(self, step: int) -> None:
        """Removes the validation records of `step` from metrics.jsonl (one about to be
        redone)."""
        if not self.enabled or not self.path.exists():
            return
        records = metrics_records(self.path)
        kept = [r for r in records if r["step"] != step or "val_loss" not in r]
        if len(kept) < len(records):
            _rewrite_metrics(self.path, kept)

    def close(self) -> None:
        """Flushes the TensorBoard writer."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            writer.close()
        except OSError:
            # A full disk: tensorboardX would flush again at exit and print a traceback
            # there; the error is raised here, once, so mark its file writers closed.
            for file_writer in (getattr(writer, "all_writers", None) or {}).values():
                event_writer = getattr(file_writer, "event_writer", None)
                if hasattr(event_writer, "_closed"):
                    event_writer._closed = True
            raise


def truncate_metrics(path: str | os.PathLike, last_step: int) -> list[dict[str, Any]]:
    """Rewrites a metrics.jsonl file with its records up to `last_step` only (a resume's or
    a fork's), and returns them. A new file is renamed over the old one, so a failure while
    writing loses no record."""
    path = Path(path)
    kept = [r for r in metrics_records(path) if r["step"] <= last_step]
    _rewrite_metrics(path, kept)
    return kept


def _rewrite_metrics(path: Path, records: list[dict[str, Any]]) -> None:
    """Replaces a metrics.jsonl file with `records`, renamed over it whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    os.replace(tmp, path)


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, float]]:
    """The records of workdir/metrics.jsonl, in order (a torn last line is left out)."""
    path = Path(workdir) / METRICS_FILE
    if not path.exists():
        return []
    return metrics_records(path)


# ----------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class ValidationData:
    """What validation needs.

    Attributes:
      batches: returns one pass over the validation pairs as [D, b, L] batches.
      sources: normalized validation sources for BLEU (every line, uncleaned).
      references: the raw reference lines, aligned with `sources`.
      tokenizer: the run's tokenizer (for BLEU decoding).
    """

    batches: Callable[[], Iterable[Batch]]
    sources: Sequence[str] = ()
    references: Sequence[str] = ()
    tokenizer: Any = None


@dataclasses.dataclass
class TrainResult:
    """How a `Trainer.run` ended.

    Attributes:
      step: updates done.
      seconds: wall time of this run (not counting earlier, resumed runs).
      interrupted: stopped early by `stop_event` (a checkpoint was saved, unless no
        update had been made).
      best_bleu: best validation BLEU of the workdir so far, or None.
      best_step: its step, or None.
      last_loss: the last logged training loss (the mean over its log window), or None.
      checkpoint_dir: where the checkpoints are.
    """

    step: int
    seconds: float
    interrupted: bool
    best_bleu: float | None
    best_step: int | None
    last_loss: float | None
    checkpoint_dir: Path


class Trainer:
    """Runs training in a workdir: resumes from its latest checkpoint, logs, validates, saves.

    Example:
      trainer = Trainer(model_config, train_config, workdir, pad_id=tok.pad_id)
      start = trainer.restore_or_init(batcher)        # 0, or the resumed step
      result = trainer.run(batcher, total_steps, validation)

    Args:
      model_config: the model.
      train_config: the recipe and schedules.
      workdir: the run directory (checkpoints, metrics).
      pad_id: the tokenizer's padding id.
      log: prints one line (validation results, warnings, the step lines below);
        defaults to tqdm.write.
      progress: show a tqdm progress bar; without one, `log` prints a line of
        the loss, learning rate and throughput every `log_every` steps instead.
      is_main_process: writes metrics only when True (multi-host runs).
      total_steps: updates in the whole run, for a learning rate cooldown
        (defaults to `train_config.steps`).
    """

    def __init__(
        self,
        model_config: TransformerConfig,
        train_config: TrainConfig,
        workdir: str | os.PathLike,
        *,
        pad_id: int,
        log: Callable[[str], None] | None = None,
        progress: bool = True,
        is_main_process: bool = True,
        total_steps: int | None = None,
    ):
        from tqdm.auto import tqdm

        self.model_config = model_config
        self.config = train_config
        self.workdir = Path(workdir)
        self.pad_id = pad_id
        self.progress = progress and is_main_process
        self.is_main_process = is_main_process
        self._log = log or tqdm.write
        self.model = Transformer(model_config)
        total_steps = total_steps or train_config.steps
        if train_config.cooldown > 0.0 and total_steps is None:
            raise ValueError("a cooldown needs total_steps (or train_config.steps)")
        recipe = _recipe(train_config, total_steps)
        self.recipe = recipe
        self.schedule = _config_schedule(recipe, model_config.d_model)
        self.optimizer, self.train_step, self.eval_step = _training_functions(
            model_config, recipe, pad_id
        )
        self.checkpoints = Checkpoints(
            self.workdir,
            keep=train_config.keep_checkpoints,
            async_save=True,  # training goes on while a checkpoint is written; close() waits
            log=lambda m: self._log(f"warning: {m}"),
        )
        self.state: TrainState | None = None  # replicated
        self._metrics: MetricsLog | None = None
        # Compiled step programs by batch layout, from `compile_steps`.
        self._train_programs: dict[Layout, Callable[..., Any]] = {}
        self._eval_programs: dict[Layout, Callable[..., Any]] = {}
        self.step = 0
        self.data_state: dict[str, Any] | None = None
        self.log_window = _LogWindow()  # the training metrics since the last log record
        # The step whose validation a stop skipped: its checkpoint says so, and a resume
        # from it runs that validation first.
        self.validation_skipped_at: int | None = None
        self.last_logged_loss: float | None = None

    # -- state

    def restore_or_init(self, batcher: Any | None = None) -> int:
        """Initializes the state, or restores the latest readable checkpoint of the workdir.

        On restore the data iterator position is restored into `batcher` too.

        Args:
          batcher: the training `data.TokenBatcher` (its `.restore(state)`), or None.

        Returns:
          The step training continues from (0 for a fresh run).

        Raises:
          CheckpointError: the checkpoints belong to another model config, or all are damaged.
        """
        fresh = create_train_state(self.model, self.optimizer, self.config.seed)
        restored = self.checkpoints.restore_latest(
            fresh.params,
            fresh.opt_state,
            _other_optimizer_forms(
                self.recipe, self.model_config.d_model, fresh.params, fresh.opt_state
            ),
        )
        if restored is None:
            host_state = fresh
        else:
            host_state = TrainState(
                step=np.asarray(restored.step, np.int32),
                params=restored.params,
                opt_state=restored.opt_state,
                rng=np.asarray(restored.meta["rng"], np.uint32),
            )
            self.data_state = restored.meta.get("data")
            self.log_window = _LogWindow(restored.meta.get("log_window"))
            skipped = restored.meta.get("validation_skipped", False)
            self.validation_skipped_at = restored.step if skipped else None
            if batcher is not None and self.data_state is not None:
                batcher.restore(self.data_state)
        self.state = replicate(host_state)
        self.step = int(host_state.step)
        return self.step

    def compile_steps(
        self,
        train_layouts: Iterable[Layout],
        eval_layouts: Iterable[Layout] = (),
        *,
        threads: int | None = None,
        stop: threading.Event | None = None,
    ) -> int:
        """Compiles the train step for each training batch layout and the eval step for each
        validation one, side by side (`compile_side_by_side`), before the first step.

        Without this each program is compiled when a batch of its shape first comes, one
        after another. Either way the steps run the same programs: on the CPU the two ways
        train to the same parameters, to the bit (tested); on a GPU the loss at step 50
        agreed to 5 decimals (one H100 run each, README).

        Args:
          train_layouts: per training batch shape, `batch_layout(batch)`: the shapes of
            src, tgt_in and tgt_out, each [D, b, L].
          eval_layouts: the same for the validation loss batches.
          threads: most programs compiled at once; default: the cores this process may use.
          stop: once set, no further program is lowered or compiled, and this returns
            without waiting for the compilations under way (`compile_side_by_side`); a
            shape left out is compiled when its first batch comes, as without this.

        Returns:
          The number of programs compiled (or loaded from the persistent cache).
        """
        from transformer.compilation_cache import compile_side_by_side

        def example(layout: Layout) -> Batch:
            return {
                name: jax.ShapeDtypeStruct(shape, jnp.int32)
                for name, shape in zip(BATCH_KEYS, layout, strict=True)
            }

        train = [
            t for t in dict.fromkeys(map(tuple, train_layouts)) if t not in self._train_programs
        ]
        evals = [e for e in dict.fromkeys(map(tuple, eval_layouts)) if e not in self._eval_programs]
        # Lowered one by one in compile_side_by_side, which sees a stop between two.
        lower_train, lower_eval = self.train_step.lower, self.eval_step.lower
        lowerings = [functools.partial(lower_train, self.state, example(t)) for t in train]
        lowerings += [functools.partial(lower_eval, self.state.params, example(e)) for e in evals]
        programs = compile_side_by_side(lowerings, threads, stop=stop)
        for table, layouts, compiled in (
            (self._train_programs, train, programs[: len(train)]),
            (self._eval_programs, evals, programs[len(train) :]),
        ):
            table.update((k, p) for k, p in zip(layouts, compiled, strict=True) if p is not None)
        return sum(p is not None for p in programs)

    def _train(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        return self._train_programs.get(batch_layout(batch), self.train_step)(state, batch)

    def _eval(self, params: PyTree, batch: Batch) -> dict[str, jax.Array]:
        return self._eval_programs.get(batch_layout(batch), self.eval_step)(params, batch)

    def save(self, *, val_bleu: float | None = None, interim: bool = False) -> None:
        """Checkpoints the current state (no-op if this step is already saved); `interim`:
        off the schedule (a stop's), so the next scheduled save deletes it."""
        host = unreplicate(self.state)
        meta = {
            "rng": [int(x) for x in np.asarray(host.rng).ravel()],
            "data": self.data_state,
            "log_window": self.log_window.state(),
        }
        if self.validation_skipped_at == self.step:
            meta["validation_skipped"] = True
        self.checkpoints.save(
            self.step, host.params, host.opt_state, meta, val_bleu=val_bleu, interim=interim
        )

    def params(self) -> PyTree:
        """The current parameters, unreplicated host numpy."""
        return unreplicate(self.state.params)

    # -- validation

    def validate(self, validation: ValidationData, *, bleu: bool) -> dict[str, float]:
        """Validation loss (and BLEU if asked) of the current parameters."""
        results = evaluate_loss(self._eval, self.state.params, validation.batches())
        if bleu and validation.sources:
            count = self.config.bleu_max_sentences or len(validation.sources)  # None: all
            results["val_bleu"] = evaluate_bleu(
                self.model,
                self.params(),
                validation.tokenizer,
                validation.sources[:count],
                validation.references[:count],
                max_tokens=self.config.bleu_max_tokens,
            )
        return results

    # -- the loop

    def run(
        self,
        batches: Iterator[tuple[Batch, dict[str, Any] | None]],
        total_steps: int,
        validation: ValidationData | None = None,
        *,
        stop_event: threading.Event | None = None,
        check_loss: Callable[[int, float], None] | None = None,
    ) -> TrainResult:
        """Trains from the current step to `total_steps`.

        Writes metrics every `log_every` steps, validates every `eval_every`
        (loss) and `bleu_every` (BLEU) steps, checkpoints every
        `checkpoint_every` steps, at each BLEU evaluation and at the end.
        Every step's loss is checked (one step late, so the host never
        stalls the device queue); a non-finite loss stops training before
        anything is saved from the bad step on.

        Args:
          batches: yields (batch, data_state_after_it); `with_data_state`
            makes one from a TokenBatcher.
          total_steps: the step to stop at.
          validation: validation data, or None to skip validation.
          stop_event: when set (e.g. by a SIGTERM handler), the current step
            finishes, a checkpoint is saved (none at step 0: an untrained one would
            join evaluate.py's average) and `run` returns with `interrupted=True`.
            In a multi-host run, set on any host, it stops every host after the same
            step, one or two steps later.
          check_loss: called as check_loss(step, loss) with every step's
            training loss; raises to stop. Default: `check_finite_loss`.

        Returns:
          A TrainResult.

        Raises:
          NonFiniteLossError: the loss became NaN or infinite.
        """
        from tqdm.auto import tqdm

        start_time = time.time()
        if self._metrics is None:
            self.open_metrics()
        bar = tqdm(
            total=total_steps,
            initial=self.step,
            disable=not self.progress,
            dynamic_ncols=True,
            unit="step",
        )
        tracker = _StepMetrics(check_loss or check_finite_loss, self.log_window)
        # A signal may reach one host of a multi-host run only, or the hosts at other
        # steps, and a host that stopped alone would leave the others waiting in the next
        # step's collectives for ever. There each step carries a vote, the sum over all
        # devices of every host's stop flag, which `tracker` reads with the loss, one step
        # late: every host reads the same sums at the same point of the loop, so all stop
        # after the same step and save the same checkpoint.
        vote = _stop_vote() if stop_event is not None and jax.process_count() > 1 else None

        def stopping() -> bool:
            if vote is not None:
                return tracker.stop_voted
            return stop_event is not None and stop_event.is_set()

        interrupted = False
        try:
            if self.validation_skipped_at == self.step and not stopping():
                self._make_up_skipped_validation(validation)
                tracker.restart_clock()
            while self.step < total_steps:
                if stopping():
                    interrupted = True
                    if not stop_event.is_set():
                        self._log(f"step {self.step}: another host was asked to stop")
                    break
                try:
                    batch, data_state = next(batches)
                except StopIteration:
                    break
                self.state, metrics = self._train(self.state, batch)
                if vote is not None:
                    flags = np.full(jax.local_device_count(), stop_event.is_set(), np.int32)
                    metrics = {**metrics, "stop_votes": vote(flags)}
                # Checks the previous step's loss while this step runs.
                tracker.push(self.step + 1, metrics)
                self.step += 1
                self.data_state = data_state
                bar.update(1)
                self._after_step(tracker, total_steps, validation, bar, stopping)
            tracker.settle()
            # A stop at the last step skipped its validation: the run is not done until a
            # resume runs it.
            interrupted = interrupted or self.validation_skipped_at == self.step
            if self.step > 0:  # before the first update there is nothing trained to keep
                # A step the schedule saved is saved already; any other is a stop's.
                self.save(interim=True)
        finally:
            bar.close()
            # Finish background writes even when a non-finite loss escapes: the
            # last good checkpoint must be complete on disk.
            self.checkpoints.wait()
        best_step = self.checkpoints.best_step()
        best_bleu = None if best_step is None else self.checkpoints.metrics(best_step)["val_bleu"]
        return TrainResult(
            step=self.step,
            seconds=time.time() - start_time,
            interrupted=interrupted,
            best_bleu=best_bleu,
            best_step=best_step,
            last_loss=self.last_logged_loss,
            checkpoint_dir=self.checkpoints.directory,
        )

    def _after_step(
        self,
        tracker: _StepMetrics,
        total_steps: int,
        validation: ValidationData | None,
        bar: Any,
        stopping: Callable[[], bool],
    ) -> None:
        """Logs, validates and checkpoints when the schedules say so; a validation due
        when a stop was asked for is skipped, since it can take longer than a scheduler
        waits between SIGTERM and SIGKILL (the checkpoint says so, and `run` resumed
        from it runs that validation first)."""
        cfg, step = self.config, self.step
        due_log = step % cfg.log_every == 0 or step == total_steps
        due_eval, due_bleu = self._validation_due(step)
        due_save = step % cfg.checkpoint_every == 0 or step == total_steps
        due_validation = validation is not None and (due_eval or due_bleu)
        if not (due_log or due_eval or due_bleu or due_save):
            return
        tracker.settle()  # nothing is saved before this step's loss is checked
        if due_log:
            record = {
                **self.log_window.means(),  # loss, nll and grad_norm since the last record
                "lr": float(self.schedule(step - 1)),
                "tokens_per_s": tracker.tokens_per_second(),
            }
            self.last_logged_loss = record["loss"]
            self._metrics.write(step, record)
            bar.set_postfix(
                loss=f"{record['loss']:.3f}",
                lr=f"{record['lr']:.2e}",
                tok_s=f"{record['tokens_per_s']:.0f}",
                refresh=False,
            )
            if self.is_main_process and not self.progress:  # a log file's progress
                self._log(
                    f"step {step}/{total_steps}: loss {record['loss']:.3f}, "
                    f"lr {record['lr']:.2e}, {record['tokens_per_s']:,.0f} target tokens/s"
                )
        val_bleu = None
        if due_validation and stopping():
            self._log(f"step {step}: validation skipped: stopping")
            self.validation_skipped_at = step  # the checkpoint saved next says so
        elif due_validation:
            val_bleu = self._validate_and_record(validation, bleu=due_bleu)
            tracker.restart_clock()  # validation time is not training throughput
        if due_save or val_bleu is not None:
            self.save(val_bleu=val_bleu)

    def _validation_due(self, step: int) -> tuple[bool, bool]:
        """Whether the schedules call for the validation loss, and for BLEU, at `step`."""
        cfg = self.config
        return (
            cfg.eval_every > 0 and step % cfg.eval_every == 0,
            cfg.bleu_every > 0 and step % cfg.bleu_every == 0,
        )

    def _make_up_skipped_validation(self, validation: ValidationData | None) -> None:
        """Runs the validation that a stop skipped at the resumed step, where the schedules
        still call for it: its record follows that step's training record in metrics.jsonl,
        and its BLEU scores the step's checkpoint, as in a run that never stopped."""
        step = self.step
        self.validation_skipped_at = None
        due_eval, due_bleu = self._validation_due(step)
        if validation is None or not (due_eval or due_bleu):
            return
        # A run killed after this record but before the meta rewrite below left one, kept
        # on resume as the step's own: the validation is run again, so it goes.
        self._metrics.drop_validation(step)
        val_bleu = self._validate_and_record(
            validation, bleu=due_bleu, note=" (skipped by the stop)"
        )
        if val_bleu is not None:
            self.checkpoints.record_bleu(step, val_bleu)
        # Run now: a later resume from this checkpoint (another --steps, a damaged newer
        # one) ran it again, a second record of the step in metrics.jsonl.
        self.checkpoints.record_meta(step, {"validation_skipped": False})

    def _validate_and_record(
        self, validation: ValidationData, *, bleu: bool, note: str = ""
    ) -> float | None:
        """Validates at the current step, writes the record to metrics.jsonl and logs it
        (with `note`); returns the validation BLEU, if it was measured."""
        results = self.validate(validation, bleu=bleu)
        self._metrics.write(self.step, results)
        self._log(f"step {self.step}: " + _format_results(results) + note)
        return results.get("val_bleu")

    def open_metrics(self) -> None:
        """Opens metrics.jsonl and TensorBoard, dropping records after the resumed step."""
        self._metrics = MetricsLog(
            self.workdir, resume_step=self.step, enabled=self.is_main_process, log=self._log
        )

    def close(self) -> None:
        """Finishes checkpoint writes and closes the logs."""
        try:
            if self._metrics is not None:
                self._metrics.close()
        finally:  # a log that cannot be flushed (a full disk) still lets the save finish
            self.checkpoints.close()


class _LogWindow:
    """Sums of the training metrics over the steps since the last log record.

    A record holds their means over its steps, not one step's values, which swing
    with the sentence lengths of that step's batch. The sums travel in each
    checkpoint (`state`), so a run stopped between two records and resumed logs
    what an unbroken run logs.
    """

    def __init__(self, state: dict[str, float] | None = None):
        self._load(state or {})

    def _load(self, state: dict[str, float]) -> None:
        self.steps = int(state.get("steps", 0))
        self.tokens = int(state.get("tokens", 0))
        self.loss_sum = float(state.get("loss_sum", 0.0))  # per-token loss x tokens
        self.nll_sum = float(state.get("nll_sum", 0.0))
        self.grad_norm_sum = float(state.get("grad_norm_sum", 0.0))

    def add(self, values: dict[str, float]) -> None:
        """Adds one step's metrics (its "loss" and "nll" are means per target token)."""
        self.steps += 1
        self.tokens += int(values["num_tokens"])
        self.loss_sum += values["loss"] * values["num_tokens"]
        self.nll_sum += values["nll"] * values["num_tokens"]
        self.grad_norm_sum += values["grad_norm"]

    def means(self) -> dict[str, float]:
        """The window's means (loss and nll per target token, grad_norm per step); then
        starts a new window."""
        tokens, steps = max(self.tokens, 1), max(self.steps, 1)
        means = {
            "loss": self.loss_sum / tokens,
            "nll": self.nll_sum / tokens,
            "grad_norm": self.grad_norm_sum / steps,
        }
        self._load({})
        return means

    def state(self) -> dict[str, float]:
        """The sums, JSON-serializable (Python floats round-trip exactly)."""
        return dict(
            steps=self.steps,
            tokens=self.tokens,
            loss_sum=self.loss_sum,
            nll_sum=self.nll_sum,
            grad_norm_sum=self.grad_norm_sum,
        )


class _StepMetrics:
    """Fetches each step's metrics one step late, checks the loss, adds it to the log
    window, and counts throughput.

    Reading a step's metrics waits for that step; reading the previous step's
    after dispatching the next keeps the device busy while the host checks.
    """

    def __init__(self, check_loss: Callable[[int, float], None], window: _LogWindow):
        self._check_loss = check_loss
        self._pending: tuple[int, dict[str, jax.Array]] | None = None
        self._tokens = 0
        self._clock = time.time()
        self.window = window
        self.stop_voted = False  # a settled step's "stop_votes" (multi-host) was positive

    def push(self, step: int, metrics: dict[str, jax.Array]) -> None:
        """Settles the previous step, then holds this one's metrics."""
        self.settle()
        self._pending = (step, metrics)

    def settle(self) -> None:
        """Fetches and checks the held step's metrics and adds them to the window."""
        if self._pending is None:
            return
        step, metrics = self._pending
        self._pending = None
        values = {k: v.item() for k, v in unreplicate(metrics).items()}
        self._check_loss(step, values["loss"])
        # A finite loss with a gradient that overflowed still leaves NaN parameters (the
        # clipped or Adam update of an infinite gradient), which must not be saved.
        if not math.isfinite(values["grad_norm"]):
            raise NonFiniteLossError(
                f"gradient norm is {values['grad_norm']} at step {step} (its loss, "
                f"{values['loss']:.4g}, is finite); {_NON_FINITE_ADVICE}"
            )
        self._tokens += int(values["num_tokens"])
        self.window.add(values)
        self.stop_voted |= values.pop("stop_votes", 0) > 0

    def tokens_per_second(self) -> float:
        """Real target tokens per second since the last call (or `restart_clock`)."""
        now = time.time()
        rate = self._tokens / max(now - self._clock, 1e-9)
        self._tokens, self._clock = 0, now
        return rate

    def restart_clock(self) -> None:
        """Starts a new throughput window."""
        self._tokens, self._clock = 0, time.time()


def _recipe(config: TrainConfig, total_steps: int | None) -> TrainConfig:
    """The fields that the compiled steps depend on (the rest set to defaults)."""
    return TrainConfig(
        steps=total_steps if config.cooldown > 0.0 else 1,
        warmup_steps=config.warmup_steps,
        learning_rate_scale=config.learning_rate_scale,
        cooldown=config.cooldown,
        cooldown_shape=config.cooldown_shape,
        label_smoothing=config.label_smoothing,
        grad_clip_norm=config.grad_clip_norm,
        weight_decay=config.weight_decay,
        adam_b1=config.adam_b1,
        adam_b2=config.adam_b2,
        adam_eps=config.adam_eps,
    )


@functools.lru_cache(maxsize=4)
def _training_functions(model_config: TransformerConfig, recipe: TrainConfig, pad_id: int):
    # Trainers of one model and recipe in a process (tests, resume) share compiled steps.
    model = Transformer(model_config)
    optimizer = make_optimizer(recipe, model_config.d_model)
    train_step = make_train_step(
        model, optimizer, label_smoothing=recipe.label_smoothing, pad_id=pad_id
    )
    eval_step = make_eval_step(model, label_smoothing=recipe.label_smoothing, pad_id=pad_id)
    return optimizer, train_step, eval_step


def check_finite_loss(step: int, loss: float) -> None:
    """The default per-step loss check: raises NonFiniteLossError on NaN or infinity.

    Args:
      step: the update (1-based) whose loss this is.
      loss: its training loss.
    """
    if not math.isfinite(loss):
        raise NonFiniteLossError(f"training loss is {loss} at step {step}; {_NON_FINITE_ADVICE}")


def with_data_state(batcher: Any) -> Iterator[tuple[Batch, dict[str, Any]]]:
    """Yields (batch, batcher.state() right after it), so the position survives prefetching.

    Args:
      batcher: a `data.TokenBatcher` (iterable of batches with `.state()`).
    """
    for batch in batcher:
        yield batch, batcher.state()


def _format_results(results: dict[str, float]) -> str:
    parts = [f"val_loss {results['val_loss']:.3f}", f"val_ppl {results['val_ppl']:.2f}"]
    if "val_bleu" in results:
        parts.append(f"val_bleu {results['val_bleu']:.2f}")
    return ", ".join(parts)


__all__ = [
    "AXIS",
    "CheckpointError",
    "MetricsLog",
    "NonFiniteLossError",
    "TrainConfig",
    "TrainResult",
    "TrainState",
    "Trainer",
    "ValidationData",
    "check_finite_loss",
    "create_train_state",
    "evaluate_bleu",
    "evaluate_loss",
    "label_smoothed_cross_entropy",
    "learning_rate_schedule",
    "make_eval_step",
    "make_optimizer",
    "make_train_step",
    "read_metrics",
    "replicate",
    "unreplicate",
    "with_data_state",
]
