"""Data parallelism: the same global batches on 1, 2 and 4 devices train the same model.

The worker runs in a subprocess with 4 fake CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=4 must be set before JAX is
imported) and trains with pmap over the first 1, 2 and 4 of them, from the same
initial state on the same global batches. Dropout is off: with dropout each
device draws its own masks (checked too), so only the dropout-free computation
can match across device counts.

What data parallelism promises is the global batch's gradient, whatever the
number of devices. Plain SGD turns that gradient into the parameters linearly,
so its parameters are compared at a tight tolerance. The recipe's Adam divides
each gradient by its own running scale, which turns the rounding of a
near-zero gradient (the cross-device sum adds in another order) into a
full-size step of random sign; with Adam the losses and gradient norms are
compared, and they depend on every earlier step's parameters.

Run as a script, this file is the worker: `python test_pmap_equivalence.py OUT_DIR`.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

STEPS = 4
GLOBAL_BATCH = 8
VOCAB = 40
OPTIMIZERS = ("sgd", "adam")
DEVICE_COUNTS = (1, 2, 4)
METRICS = ("losses", "grad_norms", "num_tokens", "val")


def _global_batches(seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Random [GLOBAL_BATCH, L] pairs with ragged lengths, so padding matters."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(STEPS):
        src_lens = rng.integers(2, 10, GLOBAL_BATCH)
        tgt_lens = rng.integers(2, 9, GLOBAL_BATCH)
        src = np.zeros((GLOBAL_BATCH, 10), np.int32)
        tgt = np.zeros((GLOBAL_BATCH, 10), np.int32)
        for i in range(GLOBAL_BATCH):
            src[i, : src_lens[i]] = rng.integers(4, VOCAB, src_lens[i])
            tgt[i, : tgt_lens[i] + 1] = rng.integers(4, VOCAB, tgt_lens[i] + 1)
        tgt_in = np.where(np.arange(10) == 0, 2, np.roll(tgt, 1, axis=1)) * (
            np.arange(10) <= tgt_lens[:, None]
        )
        tgt_out = tgt * (np.arange(10) <= tgt_lens[:, None])
        batches.append({"src": src, "tgt_in": tgt_in.astype(np.int32), "tgt_out": tgt_out})
    return batches


def _worker(out_dir: str) -> None:
    import jax
    import optax

    from transformer import Transformer, TransformerConfig
    from transformer.training import (
        TrainConfig,
        create_train_state,
        evaluate_loss,
        make_eval_step,
        make_optimizer,
        make_train_step,
        replicate,
        unreplicate,
    )

    assert jax.local_device_count() == 4, jax.local_devices()
    config = TransformerConfig.preset(
        "tiny", vocab_size=VOCAB, dropout_rate=0.0, num_encoder_layers=1, num_decoder_layers=1
    )
    model = Transformer(config)
    optimizers = {
        "sgd": optax.sgd(0.5),
        "adam": make_optimizer(TrainConfig(steps=STEPS, warmup_steps=2), config.d_model),
    }
    for name, optimizer in optimizers.items():
        initial = create_train_state(model, optimizer, seed=0)
        for num_devices in DEVICE_COUNTS:
            devices = jax.local_devices()[:num_devices]
            state = replicate(initial, devices)
            step = make_train_step(model, optimizer, label_smoothing=0.1, pad_id=0, devices=devices)
            # The validation loss of the initial parameters over all the batches: every
            # device's share counts (with device 0's alone it changed with the count).
            eval_step = make_eval_step(model, label_smoothing=0.1, pad_id=0, devices=devices)
            shards = [
                {k: v.reshape(num_devices, -1, v.shape[1]) for k, v in batch.items()}
                for batch in _global_batches()
            ]
            val = evaluate_loss(eval_step, state.params, shards)
            losses, grad_norms, num_tokens = [], [], []
            for batch in _global_batches():
                sharded = {k: v.reshape(num_devices, -1, v.shape[1]) for k, v in batch.items()}
                state, metrics = step(state, sharded)
                metrics = unreplicate(metrics)
                losses.append(metrics["loss"])
                grad_norms.append(metrics["grad_norm"])
                num_tokens.append(metrics["num_tokens"])  # weighs the log window: the global count
            updates = jax.tree.map(
                lambda new, old: new - old, unreplicate(state.params), initial.params
            )
            flat = {
                jax.tree_util.keystr(path): x
                for path, x in jax.tree_util.tree_leaves_with_path(updates)
            }
            np.savez(
                Path(out_dir) / f"{name}_{num_devices}.npz",
                losses=np.array(losses),
                grad_norms=np.array(grad_norms),
                num_tokens=np.array(num_tokens),
                val=np.array([val["val_loss"], val["val_nll"]]),
                **flat,
            )
    # Each device draws its own dropout masks: the same rows on each of 2 devices give
    # another loss than on 1 (with device 0's masks on both, the loss is the same).
    dropout_model = Transformer(config.replace(dropout_rate=0.3))
    sgd = optax.sgd(0.5)
    initial = create_train_state(dropout_model, sgd, seed=0)
    rows = {k: v[: GLOBAL_BATCH // 2] for k, v in _global_batches()[0].items()}
    dropout_losses = []
    for num_devices in (1, 2):
        devices = jax.local_devices()[:num_devices]
        step = make_train_step(dropout_model, sgd, label_smoothing=0.1, pad_id=0, devices=devices)
        same_rows = {k: np.stack([v] * num_devices) for k, v in rows.items()}
        _, metrics = step(replicate(initial, devices), same_rows)
        dropout_losses.append(unreplicate(metrics)["loss"])
    np.save(Path(out_dir) / "dropout_losses.npy", np.array(dropout_losses))


def _run_worker(tmp_path: Path) -> dict[str, list[dict[str, np.ndarray]]]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, check=True, timeout=600)
    results = {}
    for name in OPTIMIZERS:
        results[name] = []
        for n in DEVICE_COUNTS:
            with np.load(tmp_path / f"{name}_{n}.npz") as f:
                results[name].append(dict(f))
    results["dropout_losses"] = np.load(tmp_path / "dropout_losses.npy")
    return results


def test_same_global_batch_same_training_on_1_2_4_devices(tmp_path):
    results = _run_worker(tmp_path)
    one_device, two_devices = results["dropout_losses"]
    assert np.isfinite(one_device) and one_device != two_devices
    for name in OPTIMIZERS:
        one, *others = results[name]
        assert np.all(np.isfinite(one["losses"])), name
        assert not np.allclose(one["losses"][0], one["losses"][1:]), name  # parameters moved
        for other in others:
            # Adam hardly sees a gradient's scale, so with Adam only the gradient norm
            # would catch a gradient averaged instead of summed across devices.
            for metric in METRICS:
                np.testing.assert_allclose(
                    other[metric], one[metric], rtol=1e-5, err_msg=f"{name} {metric}"
                )
    one, *others = results["sgd"]
    parameters = one.keys() - set(METRICS)
    largest = max(np.abs(one[k]).max() for k in parameters)
    for other in others:
        assert other.keys() == one.keys()
        for key in parameters:
            # The total change of each parameter over the steps. Measured: at most 1.2e-7
            # apart (one float32 rounding of a parameter near 1), 9.4e-7 of the largest change.
            np.testing.assert_allclose(
                other[key], one[key], rtol=1e-4, atol=1e-5 * largest, err_msg=key
            )


if __name__ == "__main__":
    _worker(sys.argv[1])
