"""A fork of a run resumes to exactly the run it was forked from, unless told otherwise."""

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import train
from benchmarks import soup
from benchmarks.fork_run import main as fork_main
from benchmarks.soup import main as soup_main
from benchmarks.soup import soup_params
from transformer.checkpoints import CheckpointError, checkpoint_steps, restore_params
from transformer.training import read_metrics


def _flags(data_dir, workdir, *extra):
    return [
        "--workdir", str(workdir),
        "--dataset", "files", "--data-dir", str(data_dir),
        "--preset", "tiny", "--vocab-size", "400", "--max-len", "64",
        "--max-tokens", "1024", "--max-shapes", "1", "--steps", "8",
        "--warmup-steps", "4", "--cooldown", "0.5",
        "--log-every", "4", "--checkpoint-every", "4", "--keep-checkpoints", "5",
        "--eval-every", "0", "--bleu-every", "0", "--no-progress",
        *extra,
    ]  # fmt: skip


def _leaves(workdir, step):
    return jax.tree.leaves(restore_params(workdir, step)[0])


def test_a_fork_resumes_to_the_base_run_and_a_changed_fork_differs(
    multi30k_slice, tmp_path, monkeypatch, capsys
):
    data_dir = multi30k_slice(n=300)
    base = tmp_path / "base"
    assert train.main(_flags(data_dir, base)) == 0
    assert checkpoint_steps(base) == [4, 8]
    with monkeypatch.context() as m:  # workdirs named as the README's commands do
        m.chdir(tmp_path)
        assert fork_main(["base", "./relative/", "--step", "4"]) == 0
    assert checkpoint_steps(tmp_path / "relative") == [4]
    # Its curve ends where it was forked: the base run's later records are not its own.
    assert max(r["step"] for r in read_metrics(base)) == 8
    assert [r["step"] for r in read_metrics(tmp_path / "relative")] == [4]

    # Unchanged, or given the dropout key the base run already had (that of its seed, 0).
    for name, fork_extra in (("same", []), ("key0", ["--dropout-key", "0"])):
        same = tmp_path / name
        capsys.readouterr()
        assert fork_main([str(base), str(same), "--step", "4", *fork_extra]) == 0
        assert checkpoint_steps(same) == [4]
        warning = "warning: --dropout-key 0 is the key checkpoint 4 already has: the fork"
        assert (warning in capsys.readouterr().err) == (name == "key0")
        assert train.main(_flags(data_dir, same)) == 0
        for x, y in zip(_leaves(base, 8), _leaves(same, 8), strict=True):
            np.testing.assert_array_equal(x, y)

    # Another cooldown shape, or other dropout masks: the same up to step 4, not after.
    for name, fork_extra, train_extra in (
        ("sqrt", [], ["--cooldown-shape", "sqrt"]),
        ("key", ["--dropout-key", "1"], []),
    ):
        other = tmp_path / name
        assert fork_main([str(base), str(other), "--step", "4", *fork_extra]) == 0
        assert "warning" not in capsys.readouterr().err
        assert train.main(_flags(data_dir, other, *train_extra)) == 0
        for x, y in zip(_leaves(base, 4), _leaves(other, 4), strict=True):
            np.testing.assert_array_equal(x, y)
        assert any(
            not np.array_equal(x, y)
            for x, y in zip(_leaves(base, 8), _leaves(other, 8), strict=True)
        ), name

    # A soup of a run and its exact repeat is the run's own average; of two branches, between.
    for x, y in zip(
        _leaves(base, 8), jax.tree.leaves(soup_params([base, tmp_path / "same"], 1)), strict=True
    ):
        np.testing.assert_array_equal(x, y)
    mixed = jax.tree.leaves(soup_params([base, tmp_path / "key"], 1))
    for x, y, z in zip(_leaves(base, 8), _leaves(tmp_path / "key", 8), mixed, strict=True):
        np.testing.assert_allclose(z, (x.astype(np.float64) + y) / 2, rtol=1e-6, atol=1e-7)


def test_fork_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints" / "4").mkdir(parents=True)
    # A folder that is no workdir: it was "has no checkpoint 4 (it has [])".
    assert fork_main([str(tmp_path / "run"), str(tmp_path / "fork"), "--step", "4"]) == 2
    assert "has no config.json: it is not a workdir written by train.py" in capsys.readouterr().err
    (tmp_path / "run" / "config.json").write_text("{}")
    assert fork_main([str(tmp_path / "run"), str(tmp_path / "fork"), "--step", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "no checkpoint 8" in err
    assert not (tmp_path / "fork").exists()
    assert fork_main([str(tmp_path / "run"), str(tmp_path / "run"), "--step", "4"]) == 2
    assert "exists" in capsys.readouterr().err
    assert fork_main([str(tmp_path / "nope"), str(tmp_path / "fork"), "--step", "4"]) == 2
    assert capsys.readouterr().err == f"error: workdir {tmp_path / 'nope'} does not exist\n"
    # Keys are 32 bits: -1 and 2**32 would be some seed's key (2**32 is seed 0's).
    for key in ("-1", str(2**32)):
        run = [str(tmp_path / "run"), str(tmp_path / "fork"), "--step", "4"]
        assert fork_main([*run, "--dropout-key", key]) == 2
        err = capsys.readouterr().err
        assert err == f"error: --dropout-key must be in [0, 2**32), got {key}\n"
    # A checkpoint whose meta cannot be read is found after the copy: the copy goes.
    assert fork_main([*run, "--dropout-key", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "fork").exists()


def test_soup_refuses_workdirs_it_cannot_average_in_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "empty").mkdir()
    assert soup_main([str(tmp_path / "empty"), str(tmp_path / "empty"), "--split", "val"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and str(tmp_path / "empty") in err

    # Two "runs" whose parameters differ in shape: not branches of one run.
    trees = {"a": {"w": np.zeros((2, 3))}, "b": {"w": np.zeros((3, 3))}}
    monkeypatch.setattr(soup, "restore_last", lambda w, k, log: ([trees[Path(w).name]] * k, [4, 8]))
    same = soup.soup_params([Path("a"), Path("a")], 2)
    np.testing.assert_array_equal(same["w"], np.zeros((2, 3)))
    with pytest.raises(CheckpointError, match="not shaped like a's"):
        soup.soup_params([Path("a"), Path("b")], 2)


def test_soup_flags_before_the_workdirs_are_one_line_saying_the_order(monkeypatch, capsys):
    # "val" would be taken for a workdir, and evaluate.py would say --split has no value.
    monkeypatch.setattr(soup.evaluate, "main", lambda argv, load: 0)
    assert soup_main(["--split", "val", "runs/a", "runs/b"]) == 2
    assert capsys.readouterr().err == (
        "error: give the workdirs first, then evaluate.py's flags: soup.py runs/a runs/b "
        "--split val (got --split before a workdir)\n"
    )
    assert soup_main(["--average-last", "2", "runs/a", "runs/b", "--split", "val"]) == 0


def test_a_soup_is_the_mean_of_the_last_k_checkpoints_of_every_workdir(monkeypatch):
    # Each checkpoint holds its step as its weights: a's last two are 4 and 8, b's 12 and 16.
    steps = {"a": [2, 4, 8], "b": [10, 12, 16]}

    def restore_last(workdir, k, log):
        last = steps[Path(workdir).name][-k:]
        return [{"w": np.full((2,), float(s))} for s in last], last

    monkeypatch.setattr(soup, "restore_last", restore_last)
    two = soup.soup_params([Path("a"), Path("b")], 2)["w"]
    np.testing.assert_allclose(two, [10.0, 10.0])  # (4 + 8 + 12 + 16) / 4
    np.testing.assert_allclose(soup.soup_params([Path("a"), Path("b")], 1)["w"], [12.0, 12.0])


def test_soup_decodes_the_first_workdirs_model_with_the_soup_of_all(monkeypatch, capsys):
    loaded, seen = [], []
    monkeypatch.setattr(soup, "load_model", lambda w: (loaded.append(w), ("model", "tok", {}))[1])
    monkeypatch.setattr(soup, "soup_params", lambda dirs, k: ([str(d) for d in dirs], k))

    def evaluate_main(argv, load):  # evaluate.py's flags as it parses them, and what it loads
        args = soup.evaluate.parse_args(argv)
        seen.append((args, load(args)))
        return 0

    monkeypatch.setattr(soup.evaluate, "main", evaluate_main)
    # The data, the model and the tokenizer are the first workdir's; the parameters all of theirs.
    for flags, k in (([], soup.evaluate.DEFAULT_AVERAGE_LAST), (["--average-last", "3"], 3)):
        loaded.clear()
        assert soup_main(["runs/a", "runs/b", "--split", "val", "--beam", "2", *flags]) == 0
        args, run = seen.pop()
        assert args.workdir == "runs/a" and args.split == "val" and args.beam == 2
        assert args.average_last == k and [str(w) for w in loaded] == ["runs/a"]
        assert run.params == (["runs/a", "runs/b"], k)
        # The header evaluate.py prints names the checkpoints it decodes with.
        assert run.checkpoint == f"the last {k} checkpoints of each of runs/a + runs/b"
    assert soup.evaluate.DEFAULT_AVERAGE_LAST != 1  # the default above is not the flag's 1

    # No workdir at all is a usage error, not an IndexError.
    with pytest.raises(SystemExit) as exit_:
        soup_main([])
    assert exit_.value.code == 2
    assert "the following arguments are required: workdirs" in capsys.readouterr().err


def test_a_copy_that_fails_leaves_no_half_fork(tmp_path, capsys, monkeypatch):
    (tmp_path / "run" / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text("{}")
    monkeypatch.setattr("benchmarks.fork_run.checkpoint_steps", lambda workdir: [4])

    def copy_then_fail(src, dst, **kwargs):
        (Path(dst) / "part").mkdir(parents=True)
        raise OSError(28, "No space left on device", str(dst))

    monkeypatch.setattr(shutil, "copytree", copy_then_fail)
    assert fork_main([str(tmp_path / "run"), str(tmp_path / "fork"), "--step", "4"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: {tmp_path / 'fork'}: No space left on device")
        and err.count("\n") == 1
    )
    assert not (tmp_path / "fork").exists()


def _hand_made_workdir(folder: Path, metrics: bool = True) -> Path:
    """A workdir as fork_run sees one: config.json, checkpoints 4 and 8 (empty folders),
    a record at every step 1..8 and another folder of the run's holding a "8"."""
    for step in (4, 8):
        (folder / "checkpoints" / str(step)).mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "plots" / "8").mkdir(parents=True)
    if metrics:
        records = "".join(f'{{"step": {step}, "loss": 1.0}}\n' for step in range(1, 9))
        (folder / "metrics.jsonl").write_text(records)
    return folder


def test_a_fork_keeps_every_record_up_to_its_step_and_only_later_checkpoints_go(tmp_path, capsys):
    run = _hand_made_workdir(tmp_path / "run")
    assert fork_main([str(run), str(tmp_path / "fork"), "--step", "4"]) == 0
    assert (
        capsys.readouterr().out
        == f"{tmp_path / 'fork'}: checkpoints 4..4; resume it with train.py\n"
    )
    assert [r["step"] for r in read_metrics(tmp_path / "fork")] == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "fork" / "checkpoints").iterdir()) == ["4"]
    assert (tmp_path / "fork" / "plots" / "8").is_dir()  # not a checkpoint
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 9))  # the base untouched
    assert fork_main([str(run), str(tmp_path / "whole"), "--step", "8"]) == 0
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'whole'}: checkpoints 4..8;")


def test_a_workdir_without_metrics_is_forked(tmp_path):
    run = _hand_made_workdir(tmp_path / "run", metrics=False)
    assert fork_main([str(run), str(tmp_path / "fork"), "--step", "4"]) == 0
    assert not (tmp_path / "fork" / "metrics.jsonl").exists()


def test_a_fork_onto_an_existing_folder_leaves_it_as_it_was(tmp_path, capsys):
    run = _hand_made_workdir(tmp_path / "run")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    for destination in (tmp_path / "taken", run):
        assert fork_main([str(run), str(destination), "--step", "4"]) == 2
        err = capsys.readouterr().err
        assert err == f"error: {destination} exists; give a new directory\n"
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 9))


def test_fork_needs_a_step(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        fork_main([str(tmp_path / "run"), str(tmp_path / "fork")])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith("error: the following arguments are required: --step")
    )


def test_a_copy_error_of_several_files_is_one_line(tmp_path, capsys, monkeypatch):
    run = _hand_made_workdir(tmp_path / "run")

    def copy_with_errors(src, dst, **kwargs):
        Path(dst).mkdir()
        raise shutil.Error([(str(run / "a"), str(dst / "a"), "Permission denied")])

    monkeypatch.setattr(shutil, "copytree", copy_with_errors)
    assert fork_main([str(run), str(tmp_path / "fork"), "--step", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Permission denied" in err
    assert not (tmp_path / "fork").exists()


def test_a_meta_item_that_is_no_json_object_is_one_line(tmp_path, capsys):
    # A JSON list there was an AttributeError traceback when the dropout key was compared.
    (tmp_path / "run" / "checkpoints" / "4" / "meta").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text("{}")
    (tmp_path / "run" / "checkpoints" / "4" / "meta" / "metadata").write_text("[1, 2]")
    run = [str(tmp_path / "run"), str(tmp_path / "fork"), "--step", "4", "--dropout-key", "1"]
    assert fork_main(run) == 2
    assert capsys.readouterr().err == (
        f"error: checkpoint step 4 in {tmp_path / 'run' / 'checkpoints'} has a meta item that "
        "is no JSON object: [1, 2]\n"
    )
    assert not (tmp_path / "fork").exists()
