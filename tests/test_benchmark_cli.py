"""The benchmark scripts reject bad flags up front, with one `error:` line, before timing."""

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import ab_step, decode_speed, profile_step, train_speed


def usage_error(main, argv, capsys) -> str:
    """The error line `main(argv)` exits with (status 2), having printed nothing else."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    return err.splitlines()[-1]


def in_git_checkout() -> bool:
    head = ["git", "-C", str(ab_step.REPO), "rev-parse", "HEAD"]
    return subprocess.run(head, capture_output=True, check=False).returncode == 0


@pytest.fixture
def ab_step_keeps_malloc_as_it_is(monkeypatch):
    """ab_step.main imports this repository's modules afresh, so it calls the real
    keep_freed_host_memory, not conftest's stand-in; its mallopt calls are skipped here,
    since one heap for good would slow every later compile of this test process."""

    class Libc:
        def mallopt(self, param, value):
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda *args, **kwargs: Libc())


@pytest.mark.skipif(not in_git_checkout(), reason="needs the git checkout's history")
def test_ab_step_exports_a_revision_compared_with_itself_twice(tmp_path):
    folders = [ab_step.export_revision("HEAD", tmp_path, i) for i in (0, 1)]
    assert folders[0] != folders[1]
    assert all((folder / "benchmarks" / "ab_step.py").is_file() for folder in folders)
    assert ab_step.export_revision(ab_step.WORKTREE, tmp_path, 2) == ab_step.REPO


def test_ab_step_needs_a_round(capsys):
    assert usage_error(ab_step.main, ["HEAD", "HEAD", "--rounds", "0"], capsys).endswith(
        "error: --rounds must be at least 1"
    )


def test_decode_speed_rejects_an_unknown_mode(capsys):
    line = usage_error(decode_speed.main, ["--modes", "beam,gredy"], capsys)
    assert line.endswith("error: --modes: unknown mode 'gredy'; choose from beam, greedy")


def test_decode_speed_refuses_a_split_without_a_sentence_to_decode(multi30k_slice, capsys):
    # Blank lines only: it timed nothing, then divided by zero (a traceback).
    folder = multi30k_slice(n=20, splits=("train",))
    for lang in ("en", "de"):
        (folder / f"blank.{lang}").write_text("\n \n\t\n", encoding="utf-8")
    assert decode_speed.main(["--data-dir", str(folder), "--split", "blank"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # failed before a model was built
    assert err == "error: --split blank holds no source sentence to decode; choose another split\n"


def test_decode_speed_names_a_missing_split_in_one_line(multi30k_slice, capsys):
    folder = multi30k_slice(n=20, splits=("train",))
    assert decode_speed.main(["--data-dir", str(folder), "--split", "tset2016"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # failed before a model was built
    assert err.startswith("error: no split 'tset2016'") and err.count("\n") == 1


def test_train_speed_rejects_a_misspelt_preset_before_timing_any(capsys):
    line = usage_error(train_speed.main, ["--presets", "tiny,tyny", "--steps", "1"], capsys)
    assert "error: --presets: unknown preset 'tyny'; choose from " in line


def test_train_speed_needs_a_timed_step(capsys):
    line = usage_error(train_speed.main, ["--presets", "tiny", "--steps", "0"], capsys)
    assert line.endswith("error: --steps must be at least 1")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--beam", "0"], "error: --beam must be at least 1"),
        (["--max-tokens", "0"], "error: --max-tokens must be at least 1"),
        (["--limit", "-3"], "error: --limit and --max-extra-len cannot be negative"),
        (["--alpha", "nan"], "error: --alpha must be a finite number >= 0, got nan"),
        (["--alpha", "-5"], "error: --alpha must be a finite number >= 0, got -5.0"),
    ],
)
def test_decode_speed_rejects_sizes_it_cannot_decode_with(capsys, argv, message):
    assert usage_error(decode_speed.main, argv, capsys).endswith(message)


def test_decode_speed_names_a_missing_workdir_in_one_line(tmp_path, capsys):
    assert decode_speed.main(["--workdir", str(tmp_path / "nope")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"error: workdir {tmp_path / 'nope'} does not exist")


@pytest.mark.parametrize("main", [train_speed.main, profile_step.main])
def test_step_benchmarks_need_a_row_and_a_position(capsys, main):
    assert usage_error(main, ["--rows", "0"], capsys).endswith("error: --rows must be at least 1")
    assert usage_error(main, ["--tgt-len", "0"], capsys).endswith(
        "error: --tgt-len must be at least 1"
    )


def test_profile_step_rejects_a_misspelt_preset(capsys):
    line = usage_error(profile_step.main, ["--preset", "nosuch"], capsys)
    assert "error: --preset: unknown preset 'nosuch'; choose from " in line


@pytest.mark.skipif(not in_git_checkout(), reason="needs the git checkout's history")
def test_ab_step_names_a_revision_git_does_not_know_and_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        ab_step.export_revision("nosuchrev", tmp_path, 0)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: git archive nosuchrev: ") and err.count("\n") == 1


@pytest.mark.parametrize(
    "main, argv, message",
    [
        (ab_step.main, ["HEAD", "HEAD", "--rows", "0"], "--rows must be at least 1"),
        (ab_step.main, ["HEAD", "HEAD", "--length", "-1"], "--length must be at least 1"),
        (ab_step.main, ["HEAD", "HEAD", "--warmup", "-1"], "--warmup cannot be negative"),
        (ab_step.main, ["HEAD", "HEAD", "--preset", "bogus"], "--preset: unknown preset 'bogus'"),
        (ab_step.main, ["HEAD", "HEAD", "--vocab-size", "4"], "--vocab-size must be at least 5"),
        (train_speed.main, ["--vocab-size", "2"], "--vocab-size must be at least 5"),
        (train_speed.main, ["--matmul-size", "0"], "--matmul-size must be at least 1"),
        (profile_step.main, ["--vocab-size", "4"], "--vocab-size must be at least 5"),
        (profile_step.main, ["--top", "-1"], "--top must be at least 1"),
    ],
)
def test_sizes_a_step_benchmark_cannot_run_with_are_usage_errors(
    capsys, main, argv, message, ab_step_keeps_malloc_as_it_is
):
    # Each was a traceback after compiling (or a silently wrong figure: --warmup -1 timed
    # the compile as a step).
    assert message in usage_error(main, argv, capsys)


def test_train_speed_counts_the_rows_the_devices_really_train(tmp_path):
    # With 2 devices, --rows 3 trained 2 rows (1 each) and reported 3; --rows 1 timed an
    # empty batch. The default (2048 // 62 = 33 rows here) is rounded down to 32.
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    script = [sys.executable, str(Path(train_speed.__file__))]
    tiny = ["--presets", "tiny", "--steps", "1", "--matmul-size", "64"]
    for rows in ("3", "1"):
        run = subprocess.run(
            [*script, *tiny, "--rows", rows], env=env, capture_output=True, text=True
        )
        assert run.returncode == 2 and run.stdout == "", run.stderr
        assert run.stderr.splitlines()[-1].endswith(
            f"error: --rows {rows} is not a multiple of the 2 local devices, which share it"
        )
    none = str(tmp_path / "none")  # no data folder: the pipeline line is left out
    run = subprocess.run(
        [*script, *tiny, "--src-len", "31", "--tgt-len", "31", "--data-dir", none],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    # The figures are computed from the rows printed: those each step trained.
    [line] = [line for line in run.stdout.splitlines() if line.startswith("tiny: 32 x (31 src")]
    # A 64^3 probe is no peak: a utilization over 100% says so.
    utilization = float(line.split("utilization ")[1].split("%")[0])
    assert (utilization > 100) == line.endswith("(over 100%: raise --matmul-size for a true peak)")


def test_train_speed_checks_the_data_folder_before_timing(tmp_path, capsys):
    (tmp_path / "val.en").write_text("a\n")  # a folder, but without a train split
    line = usage_error(train_speed.main, ["--presets", "tiny", "--data-dir", str(tmp_path)], capsys)
    assert "error: --data-dir: no split 'train'" in line


def test_ab_step_rounds_its_default_rows_down_to_the_devices(
    monkeypatch, capsys, ab_step_keeps_malloc_as_it_is
):
    # On 3 devices it stopped with "--rows 64 is not a multiple of the 3 local devices"
    # though no --rows was given; train_speed.py and profile_step.py round theirs down.
    import jax

    class Built(Exception):
        pass

    built = []

    def build_step(folder, preset, vocab_size, rows, length, warmup):
        built.append(rows)
        raise Built

    monkeypatch.setattr(jax, "local_device_count", lambda *args, **kwargs: 3)
    monkeypatch.setattr(ab_step, "build_step", build_step)
    worktree = [ab_step.WORKTREE, ab_step.WORKTREE, "--preset", "tiny"]
    for extra, rows in (([], 63), (["--length", "31"], 33), (["--rows", "6"], 6)):
        with pytest.raises(Built):
            ab_step.main([*worktree, *extra])
        assert built.pop() == rows  # 2048 // 32 = 64 rows, so 63; 2048 // 62 = 33
    assert usage_error(ab_step.main, [*worktree, "--rows", "8"], capsys).endswith(
        "error: --rows 8 is not a multiple of the 3 local devices, which share it"
    )


@pytest.mark.skipif(not in_git_checkout(), reason="needs the git checkout's history")
def test_ab_step_refuses_a_revision_without_the_step_benchmark(
    capsys, ab_step_keeps_malloc_as_it_is
):
    first = subprocess.run(
        ["git", "-C", str(ab_step.REPO), "rev-list", "--max-parents=0", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[0]  # the first commit, from before benchmarks/train_speed.py
    line = usage_error(ab_step.main, [first, "HEAD", "--preset", "tiny"], capsys)
    assert f"error: {first} has no benchmarks/train_speed.py" in line
