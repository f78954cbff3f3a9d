"""Data parallelism: the same global batches on 1, 2 and 4 devices train the same model.

The worker runs in a subprocess with 4 fake CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=4 must be set before JAX is
imported) and trains with pmap over the first 1, 2 and 4 of them, from the same
initial state on the same global batches. Dropout is off: with dropout each
device draws its own masks, so only the dropout-free computation can match
across device counts.

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
METRICS = {"losses", "grad_norms"}  # saved beside the parameters, compared on their own


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

    from transformer import Transformer, TransformerConfig
    from transformer.training import (
        TrainConfig,
        create_train_state,
        make_optimizer,
        make_train_step,
        replicate,
        unreplicate,
    )

    assert jax.local_device_count() == 4, jax.local_devices()
    config = TransformerConfig.preset(
        "tiny", vocab_size=VOCAB, dropout_rate=0.0, num_encoder_layers=1, num_decoder_layers=1
    )
    train_config = TrainConfig(steps=STEPS, warmup_steps=2)
    model = Transformer(config)
    optimizer = make_optimizer(train_config, config.d_model)
    initial = create_train_state(model, optimizer, seed=0)
    for num_devices in (1, 2, 4):
        devices = jax.local_devices()[:num_devices]
        state = replicate(initial, devices)
        step = make_train_step(model, optimizer, label_smoothing=0.1, pad_id=0, devices=devices)
        losses, grad_norms = [], []
        for batch in _global_batches():
            sharded = {k: v.reshape(num_devices, -1, v.shape[1]) for k, v in batch.items()}
            state, metrics = step(state, sharded)
            metrics = unreplicate(metrics)
            losses.append(metrics["loss"])
            grad_norms.append(metrics["grad_norm"])
        params = unreplicate(state.params)
        leaves = jax.tree_util.tree_leaves_with_path(params)
        flat = {jax.tree_util.keystr(path): x for path, x in leaves}
        np.savez(
            Path(out_dir) / f"devices_{num_devices}.npz",
            losses=np.array(losses),
            grad_norms=np.array(grad_norms),
            **flat,
        )


def _run_worker(tmp_path: Path) -> list[dict[str, np.ndarray]]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, check=True, timeout=600)
    results = []
    for n in (1, 2, 4):
        with np.load(tmp_path / f"devices_{n}.npz") as f:
            results.append(dict(f))
    return results


def test_same_global_batch_same_training_on_1_2_4_devices(tmp_path):
    one, two, four = _run_worker(tmp_path)
    assert np.all(np.isfinite(one["losses"]))
    assert not np.allclose(one["losses"][0], one["losses"][1:])  # the parameters did move
    for other in (two, four):
        np.testing.assert_allclose(other["losses"], one["losses"], rtol=1e-5)
        # Adam hardly sees a gradient's scale, so the parameters alone would not catch a
        # gradient summed or averaged one time too many across devices; its norm does.
        np.testing.assert_allclose(other["grad_norms"], one["grad_norms"], rtol=1e-5)
        assert other.keys() == one.keys()
        for name in one.keys() - METRICS:
            if "['key']['bias']" in name:
                # Exactly zero gradient in exact arithmetic (softmax ignores a score shift
                # shared by all keys): rounding noise, which Adam (eps 1e-9) turns into
                # full-size steps of random sign. Nothing else depends on these values.
                continue
            # atol 5e-5: the largest difference is 3.8e-5, the same in every run (2026-11-22,
            # JAX 0.10.2): the cross-device sum's rounding, grown by Adam on small gradients.
            np.testing.assert_allclose(other[name], one[name], rtol=1e-4, atol=5e-5, err_msg=name)


if __name__ == "__main__":
    _worker(sys.argv[1])
