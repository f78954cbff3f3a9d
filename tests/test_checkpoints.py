"""Workdir checkpoints: round trip, last K + best retention, damaged fallback, mismatch,
and the software record of a run."""

import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from functools import partial
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from tests.make_tiny_workdir import damage_checkpoint
from transformer import Transformer, TransformerConfig, checkpoints
from transformer.checkpoints import (
    CheckpointError,
    Checkpoints,
    CheckpointWriteError,
    average_params,
    checkpoint_steps,
    environment_changes,
    kept_last,
    load_run_config,
    name_aside,
    read_meta,
    restore_chosen,
    restore_last,
    restore_params,
    save_run_config,
    software_environment,
    update_meta,
)

REPO = Path(__file__).resolve().parents[1]


def _tiny_params(d_model: int = 32, **overrides):
    config = TransformerConfig.preset(
        "tiny",
        vocab_size=20,
        d_model=d_model,
        num_encoder_layers=1,
        num_decoder_layers=1,
        **overrides,
    )
    tokens = np.ones((1, 3), np.int32)
    params = Transformer(config).init(jax.random.PRNGKey(0), tokens, tokens)["params"]
    return jax.device_get(params)


# Any non-empty optimizer state will do where the test is about the parameters.
_OPT = {"count": np.zeros((), np.int32)}


def _shifted(params, by: float):
    return jax.tree.map(lambda x: x + np.float32(by), params)


@pytest.fixture(scope="module")
def params():
    return _tiny_params()


def test_round_trip_keeps_structure_and_values(tmp_path, params):
    # The saved values come back, not the templates restore is given: an Adam state after
    # one update (moments and a count that are not zero), read into all-zero templates.
    optimizer = optax.adam(1e-3)
    saved = _shifted(params, 0.5)
    opt_state = optimizer.init(saved)
    _, opt_state = optimizer.update(_shifted(params, 0.25), opt_state, saved)
    opt_state = jax.device_get(opt_state)
    with Checkpoints(tmp_path, keep=2) as ckpts:
        ckpts.save(7, saved, opt_state, {"rng": [1, 2], "data": {"epoch": 3}})
    zeros = partial(jax.tree.map, np.zeros_like)
    with Checkpoints(tmp_path, keep=2) as ckpts:
        restored = ckpts.restore_latest(zeros(params), zeros(opt_state))
    assert restored.step == 7
    assert restored.meta == {"rng": [1, 2], "data": {"epoch": 3}, "step": 7}
    for got, want in ((restored.params, saved), (restored.opt_state, opt_state)):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
    assert int(jax.tree.leaves(restored.opt_state)[0]) == 1  # Adam's count
    only_params, step = restore_params(tmp_path, "last")
    assert step == 7 and jax.tree.structure(only_params) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(only_params), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_save_by_default_is_on_disk_when_save_returns(tmp_path):
    # A script that saves and ends without close() lost the checkpoint (only a tmp
    # folder was left) while saving was asynchronous by default; the Trainer asks for it.
    script = (
        "import sys, numpy as np\n"
        "from transformer.checkpoints import Checkpoints\n"
        "Checkpoints(sys.argv[1]).save(5, {'w': np.arange(3.0)}, {'n': np.zeros(())}, {})\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    params, step = restore_params(tmp_path, "last")
    assert step == 5
    np.testing.assert_array_equal(params["w"], np.arange(3.0))


def test_update_meta_changes_what_a_resume_reads_and_nothing_else(tmp_path, params):
    with Checkpoints(tmp_path, keep=2) as ckpts:
        for step in (4, 8):
            ckpts.save(step, params, _OPT, {"rng": [1, 2], "data": {"epoch": step}})
    changed = {"rng": [5, 6], "data": {"epoch": 4}, "step": 4}
    assert update_meta(tmp_path, 4, {"rng": [5, 6]}) == changed
    with Checkpoints(tmp_path, keep=2) as ckpts:
        assert ckpts.steps() == [4, 8]
        assert ckpts.restore(4, params, _OPT).meta == changed
        restored = ckpts.restore(8, _shifted(params, 1.0), _OPT)  # a template, not the values
    assert restored.meta == {"rng": [1, 2], "data": {"epoch": 8}, "step": 8}
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(CheckpointError, match="no checkpoint at step 5 .* available: 4, 8"):
        update_meta(tmp_path, 5, {"rng": [0, 0]})
    with pytest.raises(TypeError):  # not JSON: the saved meta item stays whole
        update_meta(tmp_path, 4, {"rng": object()})
    assert read_meta(tmp_path, 4) == changed
    # Valid JSON that no save writes, as read_meta refuses it: one line, the file as it was.
    meta_file = tmp_path / "checkpoints" / "8" / "meta" / "metadata"
    meta_file.write_text("[1, 2]")
    for read in (lambda: read_meta(tmp_path, 8), lambda: update_meta(tmp_path, 8, {"rng": [0]})):
        with pytest.raises(CheckpointError, match="step 8 .* no JSON object: \\[1, 2\\]$"):
            read()
    assert meta_file.read_text() == "[1, 2]"


def test_keeps_last_k_plus_best_and_finds_best(tmp_path, params):
    with Checkpoints(tmp_path, keep=2) as ckpts:
        for step, bleu in [(1, None), (2, 5.0), (3, None), (4, 3.0), (5, None), (6, None)]:
            ckpts.save(step, _shifted(params, step), _OPT, {}, val_bleu=bleu)
    assert checkpoint_steps(tmp_path) == [2, 5, 6]
    best, step = restore_params(tmp_path, "best")
    assert step == 2
    leaf = jax.tree.leaves(best)[0]
    np.testing.assert_array_equal(leaf, jax.tree.leaves(_shifted(params, 2))[0])
    assert restore_params(tmp_path, "last")[1] == 6
    assert restore_params(tmp_path, 5)[1] == 5
    with pytest.raises(CheckpointError, match="no checkpoint at step 4"):
        restore_params(tmp_path, 4)


def test_of_tied_best_scores_the_newest_is_best_and_is_the_one_kept(tmp_path, params):
    # Orbax's BestN keeps the newest of tied scores; "best" named the same step before the
    # tied older one was rotated out and after, so --checkpoint best did not move with it.
    with Checkpoints(tmp_path, keep=3) as ckpts:
        for step, bleu in [(1, 5.0), (2, 4.0), (3, 5.0)]:
            ckpts.save(step, _shifted(params, step), _OPT, {}, val_bleu=bleu)
        assert ckpts.steps() == [1, 2, 3] and ckpts.best_step() == 3
        for step in (4, 5, 6):
            ckpts.save(step, params, _OPT, {})
        assert ckpts.steps() == [3, 4, 5, 6] and ckpts.best_step() == 3
    best, step = restore_params(tmp_path, "best")
    assert step == 3
    np.testing.assert_array_equal(jax.tree.leaves(best)[0], jax.tree.leaves(_shifted(params, 3))[0])


def test_a_bleu_recorded_after_the_save_makes_its_step_compete_for_the_best(tmp_path, params):
    # A resumed run scores the checkpoint whose validation a stop skipped (record_bleu).
    with Checkpoints(tmp_path, keep=1) as ckpts:
        ckpts.save(1, params, _OPT, {}, val_bleu=20.0)
        ckpts.save(2, _shifted(params, 2), _OPT, {})
        ckpts.record_bleu(2, 30.0)
        assert ckpts.best_step() == 2 and ckpts.metrics(2) == {"val_bleu": 30.0}
        ckpts.save(3, params, _OPT, {})  # keep=1: the last one, and the best, step 2
        assert ckpts.steps() == [2, 3]
    best, step = restore_params(tmp_path, "best")
    assert step == 2
    np.testing.assert_array_equal(jax.tree.leaves(best)[0], jax.tree.leaves(_shifted(params, 2))[0])


def test_a_stops_checkpoint_is_kept_apart_from_the_last_k_until_a_scheduled_one_follows(
    tmp_path, params
):
    with Checkpoints(tmp_path, keep=2) as ckpts:
        for step in (2, 4, 6):
            ckpts.save(step, params, _OPT, {})
        ckpts.save(7, params, _OPT, {}, interim=True)  # a stop: it deletes nothing
        assert ckpts.steps() == [4, 6, 7]
        ckpts.save(8, params, _OPT, {})  # the resumed run's next save deletes it
        assert ckpts.steps() == [6, 8]
        # A stop that skipped a BLEU validation: the resume scores it, so it was on the
        # schedule after all, and counts among the last 2.
        ckpts.save(9, params, _OPT, {}, interim=True)
        ckpts.record_bleu(9, 12.5)
        ckpts.save(10, params, _OPT, {})
        assert ckpts.steps() == [9, 10] and ckpts.best_step() == 9
        with pytest.raises(ValueError, match="on the schedule, not interim"):
            ckpts.save(11, params, _OPT, {}, val_bleu=1.0, interim=True)


@pytest.mark.parametrize("keep", [0, -1])
def test_keeping_no_checkpoint_is_an_error(tmp_path, keep):
    with pytest.raises(ValueError, match=f"^keep must be >= 1, got {keep}$"):
        Checkpoints(tmp_path, keep=keep)
    assert not (tmp_path / "checkpoints").exists()


def test_saving_a_step_that_is_saved_already_keeps_the_first(tmp_path, params):
    # A run that ends on a checkpoint step saves it twice (the schedule's, then the end's);
    # Orbax itself refuses a second save of a step.
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(10, params, _OPT, {"rng": [0, 10]})
        ckpts.save(10, _shifted(params, 1), _OPT, {"rng": [0, 10]})
        assert ckpts.steps() == [10]
    leaf = jax.tree.leaves(restore_params(tmp_path, 10)[0])[0]
    np.testing.assert_array_equal(leaf, jax.tree.leaves(params)[0])


def test_best_falls_back_to_last_without_scores(tmp_path, params):
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(10, params, _OPT, {})
        ckpts.save(20, params, _OPT, {})
    assert restore_params(tmp_path)[1] == 20


@pytest.mark.parametrize(
    "damage", ["", "{", "[1]", '{"val_bleu": "abc"}', '{"val_bleu": null}', '{"val_bleu": [30.5]}']
)
def test_a_damaged_metrics_file_is_one_line_naming_the_bleu_to_write_back(tmp_path, params, damage):
    # Orbax reads every step's metrics when it opens the folder: a damaged one was a
    # JSONDecodeError traceback for evaluate.py (any --checkpoint) and train.py alike, and
    # a BLEU that is no number a ValueError or TypeError where the steps are ranked.
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(2, params, _OPT, {"rng": [0, 2]}, val_bleu=30.5)
        ckpts.save(4, params, _OPT, {"rng": [0, 4]}, val_bleu=20.0)
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 2, "elapsed_s": 1.0, "val_loss": 3.0, "val_bleu": 30.5}\n{"step": 4, "lo'
    )
    path = tmp_path / "checkpoints" / "2" / "metrics" / "metrics"
    path.write_text(damage)
    for read_only in (True, False):
        with pytest.raises(CheckpointError) as info:
            Checkpoints(tmp_path, read_only=read_only)
        assert str(info.value) == (
            f"checkpoint step 2 in {tmp_path / 'checkpoints'} has a damaged metrics file, "
            f'{path}; write {{"val_bleu": 30.5}} (the BLEU metrics.jsonl logged there) into it '
            "and run the same command again"
        )
    path.write_text('{"val_bleu": 30.5}')  # as it says
    assert restore_params(tmp_path, "best")[1] == 2


def test_a_missing_metrics_file_of_a_scored_step_is_one_line_not_a_lost_best(tmp_path, params):
    # Without its metrics file the best step (BLEU 30.5) was unscored without a word: "best"
    # was the last step, and the next save deleted it as older than the last `keep`.
    with Checkpoints(tmp_path, keep=1) as ckpts:
        ckpts.save(2, params, _OPT, {"rng": [0, 2]}, val_bleu=30.5)
        ckpts.save(4, params, _OPT, {"rng": [0, 4]}, val_bleu=20.0)
        ckpts.save(6, params, _OPT, {"rng": [0, 6]})  # a step without BLEU has no file
    (tmp_path / "metrics.jsonl").write_text(
        "".join(f'{{"step": {s}, "val_bleu": {b}}}\n' for s, b in ((2, 30.5), (4, 20.0)))
    )
    metrics = tmp_path / "checkpoints" / "2" / "metrics"
    shutil.rmtree(metrics)
    for read_only in (True, False):
        with pytest.raises(CheckpointError) as info:
            Checkpoints(tmp_path, keep=1, read_only=read_only)
        assert str(info.value) == (
            f"checkpoint step 2 in {tmp_path / 'checkpoints'} has no metrics file, so its "
            "validation BLEU (30.5, logged in metrics.jsonl) does not count and a later save "
            f'would delete it; write {{"val_bleu": 30.5}} into {metrics / "metrics"} (making '
            "its folder) and run the same command again"
        )
    metrics.mkdir()
    (metrics / "metrics").write_text('{"val_bleu": 30.5}')  # as it says
    with Checkpoints(tmp_path, keep=1) as ckpts:
        ckpts.save(8, params, _OPT, {"rng": [0, 8]})
    assert checkpoint_steps(tmp_path) == [2, 8]
    assert restore_params(tmp_path, "best")[1] == 2


def test_the_folder_of_a_killed_save_is_removed_by_the_next_run_only(tmp_path, params):
    # A save killed at a step off the schedule (a SIGKILL after a SIGTERM's save) left a
    # folder of the checkpoint's size that no later save replaced.
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(2, params, _OPT, {"rng": [0, 2]})
    killed = tmp_path / "checkpoints" / "7.orbax-checkpoint-tmp-1795764765"
    (killed / "params").mkdir(parents=True)
    (killed / "params" / "d").write_bytes(b"half")
    restore_params(tmp_path, "last")  # evaluation never writes
    assert killed.exists()
    with Checkpoints(tmp_path, keep=3) as ckpts:  # a resume: it removes it by its next save
        assert ckpts.steps() == [2]
        ckpts.save(4, params, _OPT, {"rng": [0, 4]})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "4"]


def test_a_damaged_best_falls_back_to_the_next_best_then_to_the_newest_readable(tmp_path, params):
    # Documented (README: --checkpoint best). Before, a damaged best fell back to the
    # newest checkpoint, unscored here, over step 4 with the next best score.
    with Checkpoints(tmp_path, keep=4) as ckpts:
        ckpts.save(1, _shifted(params, 1), _OPT, {"rng": [0, 1]}, val_bleu=30.0)
        ckpts.save(2, _shifted(params, 2), _OPT, {"rng": [0, 2]}, val_bleu=10.0)
        ckpts.save(3, _shifted(params, 3), _OPT, {"rng": [0, 3]})
        ckpts.save(4, _shifted(params, 4), _OPT, {"rng": [0, 4]}, val_bleu=20.0)
        ckpts.save(5, _shifted(params, 5), _OPT, {"rng": [0, 5]})
        assert ckpts.ranked_steps() == [1, 4, 2] and ckpts.best_step() == 1
    assert restore_params(tmp_path, "best")[1] == 1
    damaged = []
    for step_to_damage, expected in ((1, 4), (4, 2), (2, 5)):
        damage_checkpoint(tmp_path / "checkpoints" / str(step_to_damage))
        damaged.append(step_to_damage)
        warnings = []
        restored, step = restore_params(tmp_path, "best", log=warnings.append)
        assert step == expected
        # one line per damaged checkpoint passed over, best first, naming what comes next
        assert len(warnings) == len(damaged)
        for s, warning in zip(damaged, warnings, strict=True):
            assert f"step {s} " in warning and "is damaged" in warning
        then = "the next best" if expected in (4, 2) else "the newest one left"
        assert warnings[-1].endswith(f"; trying {then}")
        # what evaluate.py's header says it scored
        taken = "the best readable" if expected in (4, 2) else "the newest"
        label = restore_chosen(tmp_path, "best", log=lambda line: None).label
        assert label == f"{taken}: the best, step 1, is damaged"
        leaves = jax.tree.leaves(_shifted(params, expected))
        for a, b in zip(jax.tree.leaves(restored), leaves, strict=True):
            np.testing.assert_array_equal(a, b)


def test_damaged_latest_is_reported_and_the_one_before_used(tmp_path, params):
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(1, _shifted(params, 1), _OPT, {"rng": [0, 1]})
        ckpts.save(2, _shifted(params, 2), _OPT, {"rng": [0, 2]})
    damage_checkpoint(tmp_path / "checkpoints" / "2")
    warnings = []
    # Reading for evaluation leaves the workdir as it is.
    chosen = restore_chosen(tmp_path, "last", log=warnings.append)
    assert chosen.step == 1 and chosen.label == "the newest readable: the last, step 2, is damaged"
    assert len(warnings) == 1 and "step 2" in warnings[0] and "damaged" in warnings[0]
    with pytest.raises(CheckpointError, match="cannot be read"):
        restore_params(tmp_path, 2)
    warnings.clear()
    with Checkpoints(tmp_path, keep=3, log=warnings.append) as ckpts:
        restored = ckpts.restore_latest(params, _OPT)
    assert restored.step == 1 and restored.meta["rng"] == [0, 1]
    assert len(warnings) == 1 and "step 2" in warnings[0] and "damaged" in warnings[0]
    assert "kept as 2.damaged" in warnings[0] and "\n" not in warnings[0]


@pytest.mark.parametrize("item", ["params", "opt_state"])
def test_a_checkpoint_without_an_items_metadata_file_is_restored_by_the_templates(
    tmp_path, params, item
):
    # Without params/_METADATA Orbax reports every parameter "absent": the resume stopped,
    # telling of another model config (use a new --workdir). The arrays are all there.
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(1, _shifted(params, 1), _OPT, {"rng": [0, 1]})
        ckpts.save(2, _shifted(params, 2), _OPT, {"rng": [0, 2]})
    (tmp_path / "checkpoints" / "2" / item / "_METADATA").unlink()
    warnings = []
    with Checkpoints(tmp_path, keep=3, log=warnings.append) as ckpts:
        restored = ckpts.restore_latest(params, _OPT)
    assert warnings == [] and restored.step == 2 and restored.meta["rng"] == [0, 2]
    expected = jax.tree.leaves(_shifted(params, 2))
    for a, b in zip(jax.tree.leaves(restored.params), expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_optimizer_state_of_another_form_is_an_error_not_damage(tmp_path, params):
    # Skipped as damaged, every checkpoint of the run went with the advice to delete them.
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(1, params, _OPT, {"rng": [0, 1]})
    other = {"count": np.zeros((), np.int32), "momentum": np.zeros(3, np.float32)}
    warnings = []
    with (
        Checkpoints(tmp_path, keep=3, log=warnings.append) as ckpts,
        pytest.raises(CheckpointError, match="holds an optimizer state of another form") as e,
    ):
        ckpts.restore_latest(params, other)
    assert warnings == [] and "\n" not in str(e.value)
    # Given the form it was saved in, with the way to this one, it is restored.
    with Checkpoints(tmp_path, keep=3) as ckpts:
        to_other = lambda saved: {**saved, "momentum": np.ones(3, np.float32)}  # noqa: E731
        restored = ckpts.restore_latest(params, other, [(_OPT, to_other)])
    assert restored.step == 1 and restored.opt_state["momentum"].tolist() == [1, 1, 1]


@pytest.mark.parametrize("meta", ["{}", "null"])
def test_a_meta_item_without_the_rng_key_is_damage(tmp_path, params, meta):
    # Valid JSON, so Orbax reads it: the Trainer then failed with a KeyError traceback.
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(1, _shifted(params, 1), _OPT, {"rng": [0, 1]})
        ckpts.save(2, _shifted(params, 2), _OPT, {"rng": [0, 2]})
    (tmp_path / "checkpoints" / "2" / "meta" / "metadata").write_text(meta)
    warnings = []
    with Checkpoints(tmp_path, keep=3, log=warnings.append) as ckpts:
        restored = ckpts.restore_latest(params, _OPT)
    assert restored.step == 1 and restored.meta["rng"] == [0, 1]
    assert len(warnings) == 1 and "step 2" in warnings[0] and "damaged" in warnings[0]


def test_a_resume_sets_a_damaged_latest_aside_so_that_its_step_is_saved_again(tmp_path, params):
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(1, _shifted(params, 1), _OPT, {"rng": [0, 1]})
        ckpts.save(2, _shifted(params, 2), _OPT, {"rng": [0, 2]})
    damage_checkpoint(tmp_path / "checkpoints" / "2")
    damaged_files = {
        f.relative_to(tmp_path / "checkpoints" / "2"): f.read_bytes()
        for f in (tmp_path / "checkpoints" / "2").rglob("*")
        if f.is_file()
    }
    with Checkpoints(tmp_path, keep=3, log=lambda _: None) as ckpts:
        assert ckpts.restore_latest(params, _OPT).step == 1
        assert ckpts.steps() == [1]
        ckpts.save(2, _shifted(params, 20), _OPT, {"rng": [0, 20]})  # step 2 trained again
    warnings = []
    with Checkpoints(tmp_path, keep=3, log=warnings.append) as ckpts:
        restored = ckpts.restore_latest(params, _OPT)
    assert warnings == [] and checkpoint_steps(tmp_path) == [1, 2]
    assert restored.step == 2 and restored.meta["rng"] == [0, 20]
    retrained = jax.tree.leaves(_shifted(params, 20))
    for a, b in zip(jax.tree.leaves(restored.params), retrained, strict=True):
        np.testing.assert_array_equal(a, b)
    # The damaged files are kept, by another name, for a look.
    aside = tmp_path / "checkpoints" / "2.damaged"
    assert {f.relative_to(aside): f.read_bytes() for f in aside.rglob("*") if f.is_file()} == (
        damaged_files
    )


def test_every_checkpoint_damaged_is_an_error_that_moves_nothing(tmp_path, params):
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(1, params, _OPT, {})
        ckpts.save(2, params, _OPT, {})
    for step in (1, 2):
        damage_checkpoint(tmp_path / "checkpoints" / str(step))
    warnings = []
    with (
        Checkpoints(tmp_path, keep=3, log=warnings.append) as ckpts,
        pytest.raises(CheckpointError, match="every checkpoint .* is damaged"),
    ):
        ckpts.restore_latest(params, _OPT)
    assert len(warnings) == 2 and "kept as" not in warnings[0] + warnings[1]
    # Only the newest says another is tried: after the oldest none is left.
    assert "step 2" in warnings[0] and warnings[0].endswith("; trying the one before it")
    assert "step 1" in warnings[1] and not warnings[1].endswith("trying the one before it")
    # Left where they are, a rerun does not start over from step 0 as if there were none.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2"]


def _closed_loop_error(call: str) -> tuple[RuntimeError, asyncio.AbstractEventLoop]:
    """The "Event loop is closed" error of `loop.<call>(print)` on a closed loop, and the loop."""
    loop = asyncio.new_event_loop()
    loop.close()
    with pytest.raises(RuntimeError, match="^Event loop is closed$") as info:
        getattr(loop, call)(print)
    return info.value, loop


def _unraisable(error: BaseException, obj=None) -> types.SimpleNamespace:
    """`error` as sys.unraisablehook gets it from a thread without the Python frame that
    called the loop (as TensorStore's threads raise it)."""
    traceback = error.__traceback__ and error.__traceback__.tb_next
    return types.SimpleNamespace(
        exc_type=type(error), exc_value=error, exc_traceback=traceback, err_msg=None, object=obj
    )


def _unraisables_seen(monkeypatch) -> list:
    """What reaches sys.unraisablehook once the stray-read filter is put on it."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    monkeypatch.setattr(checkpoints, "_stray_reads_dropped", False)
    checkpoints._drop_stray_read_errors()
    return seen


def test_late_reads_of_a_failed_restore_print_no_tracebacks(monkeypatch):
    # TensorStore reports these through sys.unraisablehook, one per read still running.
    closed, loop = _closed_loop_error("call_soon_threadsafe")
    seen = _unraisables_seen(monkeypatch)
    sys.unraisablehook(_unraisable(closed))
    assert seen == []
    other = [_unraisable(RuntimeError("something else")), _unraisable(closed, obj=loop)]
    for u in other:
        sys.unraisablehook(u)
    assert seen == other


def restore_latest_read_only(workdir, params):
    with Checkpoints(workdir, read_only=True) as ckpts:
        return ckpts.restore_latest(params, _OPT)


def test_late_reads_are_dropped_from_before_a_read_starts(tmp_path, params, monkeypatch):
    # A failed restore's other reads report as soon as its event loop closes, which
    # can be before the failure reaches the caller: the filter must already be on.
    from transformer import checkpoints

    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(1, params, _OPT, {})
        ckpts.save(2, params, _OPT, {})
    damage_checkpoint(tmp_path / "checkpoints" / "2")
    filter_on_at_read = []

    def recording(read):
        def recorded(self, *args, **kwargs):  # Orbax's reads, where the late reads start
            filter_on_at_read.append(checkpoints._stray_reads_dropped)
            return read(self, *args, **kwargs)

        return recorded

    # The shape check's metadata read fails first where the damage is to array metadata.
    for name in ("restore", "item_metadata"):
        monkeypatch.setattr(
            ocp.CheckpointManager, name, recording(getattr(ocp.CheckpointManager, name))
        )
    for read in (
        lambda: restore_params(tmp_path, 2),
        lambda: restore_last(tmp_path, 2),
        lambda: restore_latest_read_only(tmp_path, params),
    ):
        monkeypatch.setattr(checkpoints, "_stray_reads_dropped", False)
        monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
        with contextlib.suppress(CheckpointError):
            read()
        assert filter_on_at_read and all(filter_on_at_read)
        filter_on_at_read.clear()


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"train": 5}, "its 'train' section is 5, not an object"),
        ({"model": [1]}, "its 'model' section is [1], not an object"),
        ({"data": "x"}, "its 'data' section is \"x\", not an object"),
        ({"environments": {}}, "its 'environments' is not a list of objects"),
        ({"environments": ["x"]}, "its 'environments' is not a list of objects"),
    ],
)
def test_a_run_config_of_wrong_types_is_one_line(tmp_path, edit, message):
    # Each was a traceback (AttributeError, TypeError) somewhere in train.py or evaluate.py.
    config = {"model": {"d_model": 32}, "data": {}, "train": {}, "environments": [], **edit}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        load_run_config(tmp_path)
    assert str(info.value) == (
        f"{tmp_path / 'config.json'}: {message}; it was edited or damaged: restore the one its "
        "run wrote"
    )


def test_an_average_past_the_kept_last_checkpoints_is_refused(tmp_path, params):
    # keep 2, the best at step 2: "--average-last 3" was the average of 2, 12 and 14.
    (tmp_path / "config.json").write_text(
        json.dumps({"model": {}, "train": {"keep_checkpoints": 2}})
    )
    with Checkpoints(tmp_path, keep=2) as ckpts:
        for step, bleu in ((2, 30.0), (4, 1.0), (12, 10.0), (14, 11.0)):
            ckpts.save(step, _shifted(params, step), _OPT, {}, val_bleu=bleu)
    assert checkpoint_steps(tmp_path) == [2, 12, 14]
    assert restore_last(tmp_path, 2)[1] == [12, 14]
    with pytest.raises(CheckpointError) as info:
        restore_last(tmp_path, 3)
    assert str(info.value) == (
        f"cannot average the last 3 checkpoints of {tmp_path}: the run keeps its last 2 "
        "(12, 14), and 2 only as its best; average at most 2, or evaluate the best with "
        "--checkpoint best"
    )


def test_an_average_may_take_a_stops_checkpoint_with_the_kept_last_ones(tmp_path, params):
    # keep 2 and a stop's checkpoint after them: 4, 6 and 7 are one stretch of the run.
    # It was refused as "its last 2 (6, 7), and 2, 4 only as its best".
    (tmp_path / "config.json").write_text(
        json.dumps({"model": {}, "train": {"keep_checkpoints": 2}})
    )
    with Checkpoints(tmp_path, keep=2) as ckpts:
        ckpts.save(2, params, _OPT, {}, val_bleu=30.0)
        for step in (4, 6):
            ckpts.save(step, _shifted(params, step), _OPT, {})
        ckpts.save(7, _shifted(params, 7), _OPT, {}, interim=True)
    assert checkpoint_steps(tmp_path) == [2, 4, 6, 7]
    assert restore_last(tmp_path, 3)[1] == [4, 6, 7]
    with pytest.raises(CheckpointError, match=r"last 3 \(4, 6, 7\), and 2 only as its best; av"):
        restore_last(tmp_path, 4)


def test_an_average_past_a_single_kept_checkpoint_is_refused(tmp_path, params):
    # keep 1: "--average-last 2" would average the best, step 2, with the newest.
    (tmp_path / "config.json").write_text(
        json.dumps({"model": {}, "train": {"keep_checkpoints": 1}})
    )
    assert kept_last(load_run_config(tmp_path)) == 1
    with Checkpoints(tmp_path, keep=1) as ckpts:
        ckpts.save(2, params, _OPT, {}, val_bleu=30.0)
        ckpts.save(4, _shifted(params, 4), _OPT, {}, val_bleu=10.0)
    assert checkpoint_steps(tmp_path) == [2, 4]
    with pytest.raises(CheckpointError, match=r"keeps its last 1 \(4\), and 2 only as its best"):
        restore_last(tmp_path, 2)


@pytest.mark.parametrize("keep", [0, -1, "2", None])
def test_a_config_that_says_no_usable_keep_averages_the_checkpoints_alone(tmp_path, params, keep):
    # An edited config.json: the average is of the checkpoints there, not refused as
    # reaching past the "last 0", nor a TypeError comparing None with 1.
    train = {} if keep is None else {"keep_checkpoints": keep}
    (tmp_path / "config.json").write_text(json.dumps({"model": {}, "train": train}))
    assert kept_last(load_run_config(tmp_path)) is None
    with Checkpoints(tmp_path, keep=3) as ckpts:
        for step in (2, 4, 6):
            ckpts.save(step, _shifted(params, step), _OPT, {})
    assert restore_last(tmp_path, 3)[1] == [2, 4, 6]


def test_a_damaged_metrics_file_names_the_last_bleu_logged_for_its_step(tmp_path, params):
    # A step validated twice (a resume from before it did it again): the second BLEU is the
    # one its checkpoint was saved with.
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(2, params, _OPT, {}, val_bleu=30.5)
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 2, "val_bleu": 25.0}\n{"step": 2, "val_bleu": 30.5}\n'
    )
    (tmp_path / "checkpoints" / "2" / "metrics" / "metrics").write_text("{")
    with pytest.raises(CheckpointError, match=r'write \{"val_bleu": 30.5\}'):
        Checkpoints(tmp_path, read_only=True)


def test_a_second_folder_set_aside_under_a_name_gets_the_next_number(tmp_path):
    # A step damaged twice: renamed onto the first one's 8.damaged, the resume would fail.
    assert name_aside(tmp_path / "8", "damaged") == tmp_path / "8.damaged"
    (tmp_path / "8.damaged").mkdir()
    assert name_aside(tmp_path / "8", "damaged") == tmp_path / "8.damaged.2"
    (tmp_path / "8.damaged.2").mkdir()
    assert name_aside(tmp_path / "8", "damaged") == tmp_path / "8.damaged.3"


def test_checkpoints_of_different_shapes_are_not_averaged(tmp_path, params):
    # A step folder of another model copied in: a NumPy broadcasting traceback before.
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(1, params, _OPT, {})
        wider = jax.tree.map(lambda x: np.concatenate([x, x], axis=-1), params)
        ckpts.save(2, wider, _OPT, {})
    with pytest.raises(CheckpointError) as info:
        restore_last(tmp_path, 2)
    message = str(info.value)
    assert message.startswith(f"cannot average checkpoints 1 and 2 of {tmp_path}: parameter ")
    assert message.endswith(
        "(a checkpoint of another model); evaluate them one by one with --checkpoint STEP"
    )


def test_restore_last_reads_the_newest_k_in_order_and_refuses_what_it_cannot_average(
    tmp_path, params
):
    with Checkpoints(tmp_path, keep=3) as ckpts:
        for step in (1, 2, 3, 4):
            ckpts.save(step, _shifted(params, step), _OPT, {})
    trees, steps = restore_last(tmp_path, 2)
    assert steps == [3, 4]
    for tree, step in zip(trees, steps, strict=True):
        expected = _shifted(params, step)
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(expected), strict=True):
            assert a.dtype == np.float32
            np.testing.assert_array_equal(a, b)
    with pytest.raises(CheckpointError, match=r"last 4 checkpoints: .* has 3 \(2, 3, 4\)"):
        restore_last(tmp_path, 4)
    for k in (0, -1):  # steps[-0:] would be all of them, steps[1:] all but the oldest
        with pytest.raises(ValueError, match=f"must be at least 1; got {k}"):
            restore_last(tmp_path, k)
    with pytest.raises(CheckpointError, match=r"no checkpoints in .*missing"):
        restore_last(tmp_path / "never_trained", 1)
    # Averaging never skips a damaged checkpoint silently: the average would be another one.
    damage_checkpoint(tmp_path / "checkpoints" / "3")
    with pytest.raises(CheckpointError, match="checkpoint step 3 in .* cannot be read") as info:
        restore_last(tmp_path, 2)
    assert "\n" not in str(info.value)
    assert str(info.value).endswith(
        "evaluate others (evaluate.py --checkpoint STEP, or --average-last K)"
    )


def _reads_as_a_run_trains(monkeypatch, workdir, params, keep, saves):
    """Checkpoints.restore_params as it goes while a train.py (keep `keep`) runs in
    `workdir`: before each read, that run saves the next of `saves` ((step, val_bleu)
    pairs), which deletes the checkpoints its policy no longer keeps."""
    read, to_save = Checkpoints.restore_params, list(saves)

    def read_as_the_run_saves(self, step):
        if to_save:
            saved, bleu = to_save.pop(0)
            with Checkpoints(workdir, keep=keep) as run:
                run.save(saved, _shifted(params, saved), _OPT, {}, val_bleu=bleu)
        return read(self, step)

    monkeypatch.setattr(Checkpoints, "restore_params", read_as_the_run_saves)


def test_an_average_of_a_run_still_training_is_of_its_checkpoints_after_a_deletion(
    tmp_path, params, monkeypatch
):
    # evaluate.py --average-last 3 while train.py (keep 3) saved step 8 and deleted step 2,
    # the oldest of the three read: that was "checkpoint step 2 ... cannot be read", as if
    # it were damaged, and no average.
    (tmp_path / "config.json").write_text(
        json.dumps({"model": {}, "train": {"keep_checkpoints": 3}})
    )
    with Checkpoints(tmp_path, keep=3) as ckpts:
        for step in (2, 4, 6):
            ckpts.save(step, _shifted(params, step), _OPT, {})
    _reads_as_a_run_trains(monkeypatch, tmp_path, params, 3, [(8, None)])
    logged = []
    trees, steps = restore_last(tmp_path, 3, log=logged.append)
    assert steps == [4, 6, 8] and checkpoint_steps(tmp_path) == [4, 6, 8]
    for tree, step in zip(trees, steps, strict=True):
        leaves = zip(jax.tree.leaves(tree), jax.tree.leaves(_shifted(params, step)), strict=True)
        assert all(np.array_equal(a, b) for a, b in leaves)
    assert logged == [
        f"checkpoint step 2 in {tmp_path / 'checkpoints'} was deleted while it was read (a "
        "run training there keeps only its last checkpoints and its best); choosing again "
        "from the checkpoints there now"
    ]


def test_the_best_of_a_run_still_training_is_chosen_again_where_a_better_one_replaced_it(
    tmp_path, params, monkeypatch
):
    # keep 1: the best, step 2, is deleted as step 6 is saved with a higher BLEU. The best
    # is then step 6, not "step 2 is damaged" and the next best.
    with Checkpoints(tmp_path, keep=1) as ckpts:
        ckpts.save(2, _shifted(params, 2), _OPT, {}, val_bleu=20.0)
        ckpts.save(4, _shifted(params, 4), _OPT, {}, val_bleu=10.0)
    _reads_as_a_run_trains(monkeypatch, tmp_path, params, 1, [(6, 30.0)])
    logged = []
    chosen = restore_chosen(tmp_path, "best", log=logged.append)
    assert (chosen.step, chosen.label) == (6, "best") and checkpoint_steps(tmp_path) == [6]
    leaves = zip(jax.tree.leaves(chosen.params), jax.tree.leaves(_shifted(params, 6)), strict=True)
    assert all(np.array_equal(a, b) for a, b in leaves)
    assert len(logged) == 1 and logged[0].startswith("checkpoint step 2 in ")


def test_a_scored_step_deleted_after_it_was_listed_is_no_missing_metrics_file(
    tmp_path, params, monkeypatch
):
    # Opening the checkpoints as a run training there deletes one it has just listed: that
    # was "checkpoint step 2 ... has no metrics file", with advice to write one.
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(2, params, _OPT, {}, val_bleu=20.0)
        ckpts.save(4, params, _OPT, {}, val_bleu=30.0)
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 2, "val_bleu": 20.0}\n{"step": 4, "val_bleu": 30.0}\n'
    )
    listed = sorted((tmp_path / "checkpoints").iterdir())
    shutil.rmtree(tmp_path / "checkpoints" / "2")
    real_iterdir = Path.iterdir
    monkeypatch.setattr(
        Path, "iterdir", lambda p: iter(listed) if p.name == "checkpoints" else real_iterdir(p)
    )
    with Checkpoints(tmp_path, read_only=True) as ckpts:
        assert ckpts.steps() == [4]


def test_a_checkpoint_deleted_at_every_read_ends_the_read_in_one_line(
    tmp_path, params, monkeypatch
):
    # A run that saves (keep 1) as fast as its newest checkpoint is read.
    with Checkpoints(tmp_path, keep=1) as ckpts:
        ckpts.save(2, _shifted(params, 2), _OPT, {})
    _reads_as_a_run_trains(monkeypatch, tmp_path, params, 1, [(4, None), (6, None), (8, None)])
    logged = []
    with pytest.raises(CheckpointError) as info:
        restore_chosen(tmp_path, "last", log=logged.append)
    assert str(info.value) == (
        f"checkpoint step 6 in {tmp_path / 'checkpoints'} was deleted while it was read (a "
        "run training there keeps only its last checkpoints and its best), 3 times in a "
        "row; evaluate once that run has stopped"
    )
    assert [line.split(" in ")[0] for line in logged] == [
        "checkpoint step 2",
        "checkpoint step 4",
    ]


def test_a_long_read_error_is_cut_between_words():
    from transformer.checkpoints import _first_line

    line = _first_line(ValueError("Requested byte range [3811, 7614) is not valid " * 9 + "\nmore"))
    assert line.endswith(" valid Requested ...") and len(line) <= 204
    assert _first_line(ValueError("short\nsecond line")) == "short"


def test_other_model_config_is_a_one_line_error(tmp_path, params):
    with Checkpoints(tmp_path) as ckpts:
        ckpts.save(3, params, _OPT, {})
    wider = _tiny_params(d_model=64)
    with Checkpoints(tmp_path) as ckpts, pytest.raises(CheckpointError) as info:
        ckpts.restore_latest(wider, _OPT)
    message = str(info.value)
    assert "does not match the model config" in message and "\n" not in message
    assert "(4, 8) there but (4, 16) now" in message
    # A checkpoint with attention biases (the default) against the paper's model, without.
    unbiased = _tiny_params(attention_bias=False)
    with Checkpoints(tmp_path / "biased") as ckpts:
        ckpts.save(3, _tiny_params(attention_bias=True), _OPT, {})
    with Checkpoints(tmp_path / "biased") as ckpts, pytest.raises(CheckpointError) as info:
        ckpts.restore_latest(unbiased, _OPT)
    assert "bias is (4, 8) there but absent now" in str(info.value)


def test_run_config_round_trip_and_missing(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_run_config(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_run_config(tmp_path)
    (tmp_path / "config.json").write_text('{"data": {}, "train": {}}')  # a KeyError later
    with pytest.raises(CheckpointError, match="has no 'model' section"):
        load_run_config(tmp_path)
    config = {"model": {"d_model": 32}, "data": {"src": "en"}, "train": {"steps": 2}}
    save_run_config(tmp_path, config)
    assert load_run_config(tmp_path) == config
    assert (tmp_path / "config.json").read_text().startswith("{\n")  # human-readable
    with pytest.raises(CheckpointError, match="no checkpoints"):
        restore_params(tmp_path)


def test_average_params():
    a = {"w": np.array([1.0, 2.0], np.float32)}
    b = {"w": np.array([3.0, 6.0], np.float32)}
    np.testing.assert_allclose(average_params([a, b])["w"], [2.0, 4.0])
    assert average_params([a])["w"].dtype == np.float32


def test_software_environment_names_the_commit_and_the_package_versions():
    environment = software_environment()
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    if head:  # a git checkout (CI clones one)
        assert environment["code"] in (head, f"{head}-dirty")
    assert environment["packages"]["jax"] == jax.__version__
    assert environment["packages"]["numpy"] == np.__version__
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    if any(x.startswith("cpu family") for x in lines):  # x86 Linux: name, family, vector width
        name = next(x for x in lines if x.startswith("model name")).split(":", 1)[1].strip()
        assert environment["cpu"].startswith(f"{name}, family ")
        flags = next(x for x in lines if x.startswith("flags")).split()
        if "avx2" in flags:
            units = ["AVX-512" if "avx512f" in flags else "AVX2"]
            if "amx_bf16" in flags:
                units.append("AMX-BF16")
            elif "avx512_bf16" in flags:
                units.append("AVX512-BF16")
            assert environment["cpu"].endswith(", " + ", ".join(units))


def test_an_installed_copy_inside_another_git_checkout_records_no_commit(tmp_path):
    # e.g. a virtual environment's site-packages inside the user's own project repository
    git = ["git", "-C", str(tmp_path), "-c", "user.name=u", "-c", "user.email=u@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "their project"], check=True)
    copy = tmp_path / "site-packages" / "transformer" / "checkpoints.py"
    copy.parent.mkdir(parents=True)
    shutil.copy(REPO / "transformer" / "checkpoints.py", copy)
    spec = importlib.util.spec_from_file_location("installed_checkpoints", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.software_environment()["code"] is None


def test_environment_changes_name_what_differs():
    before = software_environment()
    now = {**before, "packages": {**before["packages"], "jaxlib": "9.9.9"}, "code": "abc"}
    now.update(python="3.99.0", devices="8 x gpu")  # another device count rounds otherwise
    assert environment_changes(before, before) == []
    assert environment_changes(before, now) == [
        f"jaxlib {before['packages']['jaxlib']} -> 9.9.9",
        f"code {before['code']} -> abc",
        f"python {before['python']} -> 3.99.0",
        f"devices {before['devices']} -> 8 x gpu",
    ]


@pytest.mark.parametrize("when", ["save", "wait"])
def test_a_failed_write_is_one_line_that_says_how_to_resume(when, tmp_path, params, monkeypatch):
    # A full disk: Orbax raised TensorStore's ValueError, hundreds of lines into its logs.
    full = ValueError(
        'RESOURCE_EXHAUSTED: Error writing "x" in OCDBT database at local file "...": '
        "No space left on device [os_error_code='28']"
    )
    ckpts = Checkpoints(tmp_path, async_save=True)

    def fail(*args, **kwargs):
        raise full

    if when == "save":
        monkeypatch.setattr(ckpts._manager, "save", fail)
        with pytest.raises(CheckpointWriteError) as info:  # a CheckpointError: train.py exits 1
            ckpts.save(1, params, _OPT, {})
    else:  # the background write fails after save() returned: found by wait() alone
        ckpts.save(1, params, _OPT, {})
        monkeypatch.setattr(ckpts._manager, "wait_until_finished", fail)
        with pytest.raises(CheckpointWriteError) as info:
            ckpts.wait()
    message = str(info.value)
    assert message.startswith(f"cannot write a checkpoint in {tmp_path / 'checkpoints'}: no space")
    assert message.endswith("run the same command to resume from the last checkpoint")
    assert "\n" not in message and info.value.__cause__ is full
    monkeypatch.undo()
    ckpts.close()


def test_the_log_filter_drops_orbaxs_records_and_asyncios_about_its_tasks():
    import logging

    def record(name, path, message):
        return logging.LogRecord(name, logging.ERROR, path, 1, message, None, None)

    orbax_file = str(Path(ocp.__file__).parent / "checkpoint_manager.py")
    assert not checkpoints._not_from_orbax(record("absl", orbax_file, "save failed"))
    assert not checkpoints._not_from_orbax(
        record("asyncio", "/x/asyncio/base_events.py", "Task exception: /orbax/ ...")
    )
    assert checkpoints._not_from_orbax(record("absl", "/x/transformer/model.py", "other"))
    assert checkpoints._not_from_orbax(record("asyncio", "/x/base_events.py", "other task"))


def test_the_log_filter_drops_asyncios_records_of_a_damaged_checkpoints_other_reads():
    # Reading a damaged checkpoint, the first failed read is reported (one warning line)
    # and asyncio logged each other one as a never-retrieved exception when it was
    # collected: evaluate.py --checkpoint best printed up to 60 such lines in 2 of 5 runs.
    import asyncio
    import gc
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    def unretrieved(error):
        loop = asyncio.new_event_loop()
        future = loop.create_future()
        future.set_exception(error)
        del future
        gc.collect()
        loop.close()

    logger = logging.getLogger("asyncio")
    handler = Keep()
    logger.addHandler(handler)
    # Another test in this process (evaluate.main) may have put the filter on the logger,
    # where it would drop the record before this handler saw it.
    filters = logger.filters[:]
    logger.filters.clear()
    try:
        unretrieved(ValueError(
            'OUT_OF_RANGE: Error reading "decoder.layer_1.ffn.inner.kernel/0.0" in OCDBT '
            'database at local file "/w/checkpoints/20/params/": Requested byte range '
            "[45668, 49490) is not valid for value of size 100"
        ))  # fmt: skip
        unretrieved(ValueError("a task of another library"))
    finally:
        logger.removeHandler(handler)
        logger.filters[:] = filters
    damaged, other = records
    assert damaged.getMessage().startswith("Future exception was never retrieved")
    assert not checkpoints._not_from_orbax(damaged)
    assert checkpoints._not_from_orbax(other)


def test_a_bleu_read_by_hand_as_a_string_ranks_as_its_number_in_the_keep_policy(tmp_path, params):
    # A metrics file written back by hand, as its error message asks, may quote the BLEU:
    # best_step reads it as a number, and so must the rotation at the next saves.
    with Checkpoints(tmp_path, keep=1) as ckpts:
        ckpts.save(2, params, _OPT, {}, val_bleu=30.5)
    (tmp_path / "checkpoints" / "2" / "metrics" / "metrics").write_text('{"val_bleu": "30.5"}')
    with Checkpoints(tmp_path, keep=1) as ckpts:
        ckpts.save(4, params, _OPT, {}, val_bleu=20.0)
        ckpts.save(6, params, _OPT, {})
        assert ckpts.steps() == [2, 6] and ckpts.best_step() == 2


def test_a_stops_checkpoint_is_not_ranked_for_the_best(tmp_path, params):
    # Its metrics say "interim", not a BLEU: a run stopped before any validation has no
    # best (the Trainer reads the best step's val_bleu), and --checkpoint best says so.
    with Checkpoints(tmp_path, keep=2) as ckpts:
        ckpts.save(2, params, _OPT, {})
        ckpts.save(3, _shifted(params, 3), _OPT, {}, interim=True)
        assert ckpts.ranked_steps() == [] and ckpts.best_step() is None
    chosen = restore_chosen(tmp_path, "best")
    assert chosen.step == 3 and chosen.label == "the newest: no checkpoint has a validation BLEU"


def test_a_save_writes_its_step_even_below_the_newest_and_records_that_step(tmp_path, params):
    # "no-op if it exists" only: Orbax by itself skips a step not above its newest one.
    # The meta item says the checkpoint's own step, whatever "step" the meta given holds
    # (e.g. a meta read back from another checkpoint).
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(4, params, _OPT, {"rng": [0, 4]})
        ckpts.save(2, _shifted(params, 2), _OPT, {"rng": [0, 2], "step": 4})
        assert ckpts.steps() == [2, 4]
        assert ckpts.restore(2, params, _OPT).meta == {"rng": [0, 2], "step": 2}
    assert read_meta(tmp_path, 2)["step"] == 2


def test_a_numpy_bleu_is_saved_and_recorded_as_a_number(tmp_path, params):
    # A BLEU computed as a numpy scalar (float32 is not JSON) scores the checkpoint.
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(2, params, _OPT, {}, val_bleu=np.float32(27.5))
        ckpts.save(4, params, _OPT, {})
        ckpts.record_bleu(4, np.float32(28.5))
        assert ckpts.metrics(2) == {"val_bleu": 27.5} and ckpts.metrics(4) == {"val_bleu": 28.5}
        assert ckpts.ranked_steps() == [4, 2]


def test_record_meta_changes_the_given_entries_and_keeps_the_others(tmp_path, params):
    # As a resume reads it: the rest of the meta item (rng, data position) is untouched.
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(
            2, params, _OPT, {"rng": [0, 2], "data": {"epoch": 1}, "validation_skipped": True}
        )
        ckpts.record_meta(2, {"validation_skipped": False})
        restored = ckpts.restore_latest(params, _OPT)
    expected = {"rng": [0, 2], "data": {"epoch": 1}, "validation_skipped": False, "step": 2}
    assert restored.meta == expected


def test_a_bleu_recorded_right_after_a_background_save_waits_for_it(tmp_path, params):
    # The rewrite goes where the finished save is, not into a folder the save then meets.
    with Checkpoints(tmp_path, keep=3, async_save=True) as ckpts:
        big = jax.tree.map(lambda x: np.tile(x, (64,) + (1,) * (x.ndim - 1)), params)
        ckpts.save(2, big, _OPT, {"rng": [0, 2]})
        ckpts.record_bleu(2, 31.0)
        ckpts.record_meta(2, {"validation_skipped": False})
    with Checkpoints(tmp_path, keep=3) as ckpts:
        assert ckpts.steps() == [2] and ckpts.metrics(2) == {"val_bleu": 31.0}
    assert read_meta(tmp_path, 2) == {"rng": [0, 2], "validation_skipped": False, "step": 2}


def test_a_rewrite_is_one_process_writing_then_every_process_at_a_barrier(
    tmp_path, params, monkeypatch
):
    # Several hosts: no process goes on (and reads the file) before process 0 rewrote it.
    events = []
    write = checkpoints.write_text_atomically
    monkeypatch.setattr(
        checkpoints,
        "write_text_atomically",
        lambda path, text: (events.append(("write", Path(path).parent.name)), write(path, text)),
    )
    monkeypatch.setattr(
        ocp.multihost, "sync_global_processes", lambda name, *a, **k: events.append(("sync",))
    )
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(2, params, _OPT, {"rng": [0, 2]})
        events.clear()
        ckpts.record_bleu(2, 31.0)
        ckpts.record_meta(2, {"validation_skipped": False})
        assert events == [("write", "metrics"), ("sync",), ("write", "meta"), ("sync",)]
        monkeypatch.setattr(jax, "process_index", lambda: 1)  # another host writes nothing
        events.clear()
        ckpts.record_bleu(2, 5.0)
        assert events == [("sync",)]


def test_a_full_disk_when_a_bleu_is_recorded_is_one_line(tmp_path, params, monkeypatch):
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(2, params, _OPT, {"rng": [0, 2]})

        def full(path, text):
            raise OSError(28, "No space left on device", str(path))

        monkeypatch.setattr(checkpoints, "write_text_atomically", full)
        with pytest.raises(CheckpointWriteError, match="no space left on device; make room"):
            ckpts.record_bleu(2, 31.0)


def test_without_the_optimizer_states_metadata_the_runs_own_form_is_restored(tmp_path, params):
    # The Trainer offers the other optimizer forms; with no metadata to pick by, the
    # restore takes this run's form, not another one (which read as damage).
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(1, params, _OPT, {"rng": [0, 1]})
        ckpts.save(2, params, _OPT, {"rng": [0, 2]})
    (tmp_path / "checkpoints" / "2" / "opt_state" / "_METADATA").unlink()
    other = {"count": np.zeros((), np.int32), "momentum": np.zeros(3, np.float32)}
    warnings = []
    with Checkpoints(tmp_path, keep=3, log=warnings.append) as ckpts:
        restored = ckpts.restore_latest(params, _OPT, [(other, lambda saved: _OPT)])
    assert warnings == [] and restored.step == 2 and set(restored.opt_state) == {"count"}


def test_a_read_only_resume_past_a_damaged_checkpoint_moves_nothing(tmp_path, params):
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(1, params, _OPT, {"rng": [0, 1]})
        ckpts.save(2, params, _OPT, {"rng": [0, 2]})
    damage_checkpoint(tmp_path / "checkpoints" / "2")
    warnings = []
    with Checkpoints(tmp_path, read_only=True, log=warnings.append) as ckpts:
        assert ckpts.restore_latest(params, _OPT).step == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2"]
    assert len(warnings) == 1 and "kept as" not in warnings[0]
    assert warnings[0].endswith("; trying the one before it")


def test_a_resume_sets_every_damaged_newer_checkpoint_aside(tmp_path, params):
    # Two newest damaged: each is reported and renamed, so that training saves both again
    # (a damaged 2 left in place would make the save of step 2 a no-op).
    with Checkpoints(tmp_path, keep=3) as ckpts:
        for step in (1, 2, 3):
            ckpts.save(step, params, _OPT, {"rng": [0, step]})
    for step in (2, 3):
        damage_checkpoint(tmp_path / "checkpoints" / str(step))
    warnings = []
    with Checkpoints(tmp_path, keep=3, log=warnings.append) as ckpts:
        assert ckpts.restore_latest(params, _OPT).step == 1
        assert ckpts.steps() == [1]
    assert [w.split(" in ")[0] for w in warnings] == ["checkpoint step 3", "checkpoint step 2"]
    assert "kept as 3.damaged" in warnings[0] and "kept as 2.damaged" in warnings[1]


def test_a_step_damaged_a_second_time_is_set_aside_beside_the_first(tmp_path, params):
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(1, params, _OPT, {"rng": [0, 1]})
        ckpts.save(2, params, _OPT, {"rng": [0, 2]})
    for kept_as in ("2.damaged", "2.damaged.2"):
        damage_checkpoint(tmp_path / "checkpoints" / "2")
        warnings = []
        with Checkpoints(tmp_path, keep=3, log=warnings.append) as ckpts:
            assert ckpts.restore_latest(params, _OPT).step == 1
            ckpts.save(2, params, _OPT, {"rng": [0, 2]})  # trained again
        assert f"kept as {kept_as};" in warnings[0]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["1", "2", "2.damaged", "2.damaged.2"]


def test_a_damaged_checkpoint_that_cannot_be_renamed_is_one_line(tmp_path, params, monkeypatch):
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(1, params, _OPT, {"rng": [0, 1]})
        ckpts.save(2, params, _OPT, {"rng": [0, 2]})
    damage_checkpoint(tmp_path / "checkpoints" / "2")

    def denied(self, target):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "rename", denied)
    with (
        Checkpoints(tmp_path, keep=3, log=lambda _: None) as ckpts,
        pytest.raises(CheckpointError) as info,
    ):
        ckpts.restore_latest(params, _OPT)
    assert str(info.value) == (
        f"checkpoint step 2 in {tmp_path / 'checkpoints'} is damaged and cannot be renamed to "
        "2.damaged (Permission denied); move or delete it, then resume"
    )


def test_a_damaged_metrics_file_of_a_step_without_a_logged_bleu_says_to_write_no_bleu(
    tmp_path, params
):
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(2, params, _OPT, {}, val_bleu=30.5)
    path = tmp_path / "checkpoints" / "2" / "metrics" / "metrics"
    path.write_text("{")
    with pytest.raises(CheckpointError) as info:
        Checkpoints(tmp_path, read_only=True)
    assert str(info.value).endswith(
        f"{path}; write {{}} (metrics.jsonl logged no BLEU there) into it and run the same "
        "command again"
    )


def test_metrics_records_skip_lines_that_are_not_records(tmp_path):
    # A damaged or edited metrics.jsonl: JSON that is no record, a step that is no
    # integer, bytes that are not UTF-8; the records around them are kept.
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(
        b'{"step": 1, "loss": 2.0}\n5\n[1]\n{"loss": 1.0}\n{"step": "3"}\n\xff\xfe\n'
        b'{"step": 4, "loss": 1.5}\n'
    )
    assert checkpoints.metrics_records(path) == [
        {"step": 1, "loss": 2.0},
        {"step": 4, "loss": 1.5},
    ]


def test_a_read_error_of_exactly_the_limit_or_of_no_text_is_whole():
    from transformer.checkpoints import _first_line

    assert _first_line(ValueError("x" * 200)) == "x" * 200
    assert _first_line(OSError()) == ""  # e.g. a bare OSError() from a damaged read


def test_a_workdir_without_checkpoints_has_none_to_list_or_update(tmp_path, params):
    assert checkpoint_steps(tmp_path / "never_trained") == []
    (tmp_path / "checkpoints").mkdir()
    assert checkpoint_steps(tmp_path) == []
    with pytest.raises(CheckpointError, match=r"no checkpoint at step 4 in .*; available: none$"):
        update_meta(tmp_path, 4, {"rng": [0, 0]})
    with pytest.raises(CheckpointError, match=r"^no checkpoints in .*; train with train.py first$"):
        restore_params(tmp_path, "last")


def test_a_best_that_cannot_be_read_is_tried_once(tmp_path, params):
    # Every checkpoint damaged: one warning per checkpoint, then the error of the last one.
    with Checkpoints(tmp_path, keep=3) as ckpts:
        ckpts.save(1, params, _OPT, {}, val_bleu=30.0)
        ckpts.save(2, params, _OPT, {})
    for step in (1, 2):
        damage_checkpoint(tmp_path / "checkpoints" / str(step))
    warnings = []
    with pytest.raises(CheckpointError, match="checkpoint step 2 in .* cannot be read"):
        restore_params(tmp_path, "best", log=warnings.append)
    assert len(warnings) == 1 and warnings[0].startswith("checkpoint step 1 in ")
    assert warnings[0].endswith("; trying the newest one left")


def test_an_average_is_the_exact_mean_rounded_once_to_float32():
    # Summed in float32, 1 + 2**-24 + 2**-24 loses both small terms.
    trees = [{"w": np.float32(x)} for x in (1.0, 2.0**-24, 2.0**-24)]
    assert average_params(trees)["w"] == np.float32((1.0 + 2.0**-23) / 3)
    with pytest.raises(ValueError, match="needs at least one parameter tree"):
        average_params([])


def test_a_long_section_of_the_wrong_type_is_shown_to_40_characters(tmp_path):
    config = {"model": {}, "train": "x" * 60}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"its 'train' section is \"{'x' * 39}, not an"):
        load_run_config(tmp_path)


@pytest.mark.parametrize("text", ["{", "[1]", "5"])
def test_a_run_config_that_is_no_json_object_is_one_line(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="is not valid JSON|has no 'model' section"):
        load_run_config(tmp_path)


def test_a_workdir_that_is_a_file_is_named_as_one(tmp_path):
    (tmp_path / "notes").write_text("not a workdir")
    with pytest.raises(CheckpointError, match=r"^workdir .*notes is a file, not a directory$"):
        load_run_config(tmp_path / "notes")


def test_the_software_changes_of_a_resume_are_against_the_last_record(tmp_path):
    # Runs that were resumed before: the first record's versions are not today's.
    first = {**software_environment(), "step": 0}
    first["packages"] = {**first["packages"], "jaxlib": "0.0.1"}
    last = {**software_environment(), "step": 4}
    save_run_config(tmp_path, {"model": {}, "environments": [first, last]})
    assert checkpoints.record_environment(tmp_path, 8) == []
    assert [e["step"] for e in load_run_config(tmp_path)["environments"]] == [0, 4, 8]


def test_only_the_closed_loop_error_of_a_late_read_is_dropped(monkeypatch):
    # "Event loop is closed" from any other call than TensorStore's callback still shows.
    elsewhere, _ = _closed_loop_error("call_soon")
    seen = _unraisables_seen(monkeypatch)
    unraisable = _unraisable(elsewhere)
    assert unraisable.exc_traceback is not None  # in call_soon, not call_soon_threadsafe
    sys.unraisablehook(unraisable)
    assert seen == [unraisable]


def test_a_run_file_is_known_through_a_link_to_it_or_to_its_workdir(tmp_path):
    # e.g. evaluate.py --output onto the workdir's config.json by a linked folder's name
    workdir = tmp_path / "run"
    workdir.mkdir()
    (tmp_path / "run_link").symlink_to(workdir)
    (tmp_path / "config_link.json").symlink_to(workdir / "config.json")
    assert checkpoints.is_run_file(workdir, tmp_path / "run_link" / "config.json")
    assert checkpoints.is_run_file(tmp_path / "run_link", workdir / "checkpoints" / "2")
    assert checkpoints.is_run_file(workdir, tmp_path / "config_link.json")
    assert not checkpoints.is_run_file(workdir, tmp_path / "run_link" / "translations.txt")


def test_a_run_under_way_is_known_by_the_live_process_its_lock_names(tmp_path, monkeypatch):
    lock = tmp_path / checkpoints.LOCK_FILE
    assert checkpoints.training_process(tmp_path) is None  # no lock file
    lock.write_text(f"{os.getpid()}\n")
    assert checkpoints.training_process(tmp_path) == os.getpid()
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    # A killed run's file, a damaged one, and ids that name no single process.
    for text in (f"{ended.pid}\n", "", "12ab\n", "0\n", "-1\n", f"{2**70}\n"):
        lock.write_text(text)
        assert checkpoints.training_process(tmp_path) is None, text
    lock.write_text("1\n")  # another user's process: os.kill may not signal it, but it is there

    def not_permitted(pid, signal):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(checkpoints.os, "kill", not_permitted)
    assert checkpoints.training_process(tmp_path) == 1
    assert checkpoints.training_there(tmp_path, "wait") == (
        f"; train.py (process 1) is training in {tmp_path}: wait"
    )
