"""The benchmark scripts reject bad flags up front, with one `error:` line, before timing;
what they print is counted from what they ran (decode_speed, ab_step: with a fake clock)."""

import ctypes
import importlib
import itertools
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks import ab_step, decode_speed, profile_step, train_speed
from tests.make_tiny_workdir import make_tiny_workdir


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
    since one heap for good would slow every later compile of this test process. Gives
    the list of the (param, value) pairs it was asked to set."""
    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda *args, **kwargs: Libc())
    return calls


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
    line = usage_error(decode_speed.main, ["--modes", "bem,gredy"], capsys)
    assert line.endswith("error: --modes: unknown mode 'bem'; choose from beam, greedy")


def test_decode_speed_refuses_a_split_without_a_sentence_to_decode(multi30k_slice, capsys):
    # Blank lines only: it timed nothing, then divided by zero (a traceback).
    folder = multi30k_slice(n=20, splits=("train",))
    for lang in ("en", "de"):
        (folder / f"blank.{lang}").write_text("\n \n\t\n", encoding="utf-8")
    assert decode_speed.main(["--data-dir", str(folder), "--split", "blank"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # failed before a model was built
    assert err == "error: --split blank holds no source sentence to decode; choose another split\n"
    # With --limit, the lines looked at are said.
    argv = ["--data-dir", str(folder), "--split", "blank", "--limit", "2"]
    assert decode_speed.main(argv) == 2
    assert capsys.readouterr().err == (
        "error: the first 2 lines of --split blank hold no source sentence to decode; "
        "choose another split\n"
    )


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
        (["--alpha", "inf"], "error: --alpha must be a finite number >= 0, got inf"),
        (["--max-extra-len", "-1"], "error: --limit and --max-extra-len cannot be negative"),
    ],
)
def test_decode_speed_rejects_sizes_it_cannot_decode_with(capsys, argv, message):
    assert usage_error(decode_speed.main, argv, capsys).endswith(message)


def test_decode_speed_accepts_the_smallest_sizes_and_spaced_modes():
    # alpha 0 is no length penalty; max-extra-len 0 decodes up to the source's length.
    argv = ["--alpha", "0", "--max-extra-len", "0", "--beam", "1", "--max-tokens", "1"]
    args = decode_speed.parse_args([*argv, "--modes", " greedy, beam "])
    assert (args.alpha, args.max_extra_len, args.beam, args.max_tokens) == (0, 0, 1, 1)
    assert args.modes == ["greedy", "beam"]


def test_decode_speed_names_a_missing_workdir_in_one_line(tmp_path, capsys):
    assert decode_speed.main(["--workdir", str(tmp_path / "nope")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"error: workdir {tmp_path / 'nope'} does not exist")


@pytest.mark.parametrize("main", [train_speed.main, profile_step.main])
def test_step_benchmarks_need_a_row_and_a_position(capsys, main):
    assert usage_error(main, ["--rows", "0"], capsys).endswith("error: --rows must be at least 1")
    for flag in ("--src-len", "--tgt-len"):
        assert usage_error(main, [flag, "0"], capsys).endswith(f"error: {flag} must be at least 1")


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
    assert "fatal: " in err  # git's own reason


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


def test_train_speed_gives_each_device_a_row_where_the_budget_holds_none(monkeypatch):
    # 2048 // (1500 + 1500) = 0 rows: one per device still, not one for 2 devices (which
    # make_step_inputs refuses, as it refuses any split the devices cannot share).
    import jax

    monkeypatch.setattr(jax, "local_device_count", lambda *args, **kwargs: 2)
    assert train_speed.step_rows(None, None, 1500, 1500) == 2
    config = train_speed.TransformerConfig.preset("tiny", vocab_size=8)
    with pytest.raises(ValueError, match=r"rows \(3\) must be a multiple of the 2 local devices"):
        train_speed.make_step_inputs(config, 3, 2, 2)


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


@pytest.fixture(scope="module")
def tiny_run(multi30k_dir, tmp_path_factory):
    """A 2-step tiny workdir (it never ends a sentence) whose data folder has a split
    "mixed" of 5 short lines, the second empty."""
    workdir = make_tiny_workdir(tmp_path_factory.mktemp("decode") / "run", multi30k_dir)
    mixed = ["A dog runs on the grass.", "", "A cat sleeps on a sofa.", "A man rides a bike."]
    for lang in ("en", "de"):
        text = "\n".join([*mixed, "Two girls play in the water."]) + "\n"
        (workdir.parent / "tiny_data" / f"mixed.{lang}").write_text(text, encoding="utf-8")
    return workdir


@pytest.fixture
def decode_clock(monkeypatch):
    """decode_speed's clock, read 4 times per timed search: compiling takes 2 s, decoding
    1 s with the cache and 4 s without it."""
    ticks = itertools.cycle([0.0, 2.0, 2.0, 3.0, 0.0, 2.0, 2.0, 6.0])
    monkeypatch.setattr(
        decode_speed, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks))
    )


@pytest.fixture
def compiled_searches(monkeypatch):
    """The searches decode_speed compiles, each as (name, its keyword arguments)."""
    compiled = []

    class Recorded:
        def __init__(self, search):
            self.search = search

        def lower(self, *args, **kwargs):
            compiled.append((self.search.__name__, kwargs))
            return self.search.lower(*args, **kwargs)

    for name in ("beam_search", "greedy_search"):
        monkeypatch.setattr(decode_speed, name, Recorded(getattr(decode_speed, name)))
    return compiled


def test_decode_speed_table_counts_the_sentences_and_tokens_it_decoded(
    tiny_run, decode_clock, compiled_searches, capsys
):
    from transformer.translate import encode_sources, load_run

    argv = ["--workdir", str(tiny_run), "--split", "mixed", "--limit", "4", "--beam", "2"]
    assert decode_speed.main([*argv, "--max-extra-len", "3", "--alpha", "0.5"]) == 0
    # Each search with the flags given, with the cache and without it.
    tokenizer = load_run(tiny_run).tokenizer
    ids = dict(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    assert compiled_searches == [
        ("beam_search", dict(ids, max_extra_len=3, use_cache=True, beam_size=2, alpha=0.5)),
        ("beam_search", dict(ids, max_extra_len=3, use_cache=False, beam_size=2, alpha=0.5)),
        ("greedy_search", dict(ids, max_extra_len=3, use_cache=True)),
        ("greedy_search", dict(ids, max_extra_len=3, use_cache=False)),
    ]
    lines = capsys.readouterr().out.splitlines()
    # The first 4 lines, of which the empty one is not decoded: 3 sentences, in one batch
    # (padded to 4 rows, the copy not counted). None ends, so each decodes to its length
    # limit, source length (end token included) + 3: that many tokens each.
    sources = (tiny_run.parent / "tiny_data" / "mixed.en").read_text().splitlines()[:4]
    ids = [x for x in encode_sources(tokenizer, sources) if x]
    tokens = sum(len(x) + 3 for x in ids)
    assert len(ids) == 3 and tokens > 3 * 4
    # The best checkpoint, as evaluate.py scores by default; here, with no BLEU, the newest.
    assert (
        lines[0] == f"model: {tiny_run} (step 2 (the newest: no checkpoint has a validation BLEU))"
    )
    assert lines[1].startswith(
        "data: mixed, 3 sentences (--limit), 1 batches of <= 4096 source tokens; "
        "model d_model=32 layers=2+2 vocab=400; device: "
    )
    rows = [line.split() for line in lines[3:]]
    for at, name in ((0, ["beam", "2"]), (3, ["greedy"])):
        # sentences/s and tokens/s per decoding second, compiling not counted
        assert rows[at] == [*name, "yes", "2.0", "1.0", "3.0", str(tokens), "3/3"]
        assert rows[at + 1] == [*name, "no", "2.0", "4.0", "0.8", f"{tokens / 4:.0f}", "3/3"]
        assert lines[3 + at + 2] == (
            f"{' '.join(name)}: cached is 4.0x faster than uncached; identical outputs: yes"
        )
    assert len(lines) == 10 and lines[-1].startswith("'hit limit': sentences that reached")


def test_decode_speed_counts_the_sentences_that_ended_and_compares_every_batch(
    tiny_run, decode_clock, compiled_searches, monkeypatch, capsys
):
    import jax.numpy as jnp

    load_run, benchmark = decode_speed.load_run, decode_speed.benchmark

    def ends_at_once(*args, **kwargs):
        """The run with its last layer's output fixed to (a multiple of) the end token's
        embedding, which is made 100 times longer: every output is its end token."""
        run = load_run(*args, **kwargs)
        eos = run.tokenizer.eos_id
        table = jnp.asarray(run.params["shared_embedding"]["embedding"])
        norm = {"scale": jnp.zeros(32), "bias": table[eos] / jnp.linalg.norm(table[eos])}
        layer = dict(run.params["decoder"]["layer_1"], ffn_block={"norm": norm})
        params = {
            **run.params,
            "decoder": {**run.params["decoder"], "layer_1": layer},
            "shared_embedding": {"embedding": table.at[eos].multiply(100.0)},
        }
        return run._replace(params=params)

    def last_batch_differs(*args, use_cache, **kwargs):
        """Without the cache, the last batch's first output starts with another token."""
        compile_s, decode_s, outputs = benchmark(*args, use_cache=use_cache, **kwargs)
        if not use_cache:
            outputs[-1] = outputs[-1].copy()
            outputs[-1][0, 0] += 1
        return compile_s, decode_s, outputs

    monkeypatch.setattr(decode_speed, "load_run", ends_at_once)
    monkeypatch.setattr(decode_speed, "benchmark", last_batch_differs)
    argv = ["--workdir", str(tiny_run), "--split", "mixed", "--modes", "greedy"]
    assert decode_speed.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("data: mixed, 4 sentences, 2 batches of <= 4096 ")
    # One token each (the end token): no sentence at its limit, but the one changed.
    assert [line.split() for line in lines[3:5]] == [
        ["greedy", "yes", "2.0", "1.0", "4.0", "4", "0/4"],
        ["greedy", "no", "2.0", "4.0", "1.0", "1", "1/4"],
    ]
    assert lines[5] == "greedy: cached is 4.0x faster than uncached; identical outputs: NO"

    # The first 3 sentences (of one padded length), one per batch: compiled once, timed once.
    compiled_searches.clear()
    assert decode_speed.main([*argv, "--limit", "4", "--max-tokens", "1", "--no-uncached"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("data: mixed, 3 sentences (--limit), 3 batches of <= 1 ")
    assert [line.split() for line in lines[3:-1]] == [
        ["greedy", "yes", "2.0", "1.0", "3.0", "3", "0/3"]
    ]
    assert len(compiled_searches) == 1


def fake_revision(folder: Path, marker: str) -> Path:
    """A revision whose `transformer` and `train` say `marker` and whose train_speed's
    step writes its arguments to `folder/calls` at each call, adding 1 to the state, and
    "ready" when its metrics are waited for."""
    (folder / "transformer").mkdir(parents=True)
    (folder / "benchmarks").mkdir()
    (folder / "transformer" / "__init__.py").write_text(
        f"MARKER = {marker!r}\n"
        "class TransformerConfig:\n"
        "    @staticmethod\n"
        "    def preset(name, vocab_size):\n"
        "        return (name, vocab_size)\n"
    )
    (folder / "benchmarks" / "__init__.py").write_text("")
    (folder / "train.py").write_text(f"MARKER = {marker!r}\n")
    (folder / "transformer" / "only_here.py").write_text("")
    (folder / "benchmarks" / "train_speed.py").write_text(
        "from pathlib import Path\n"
        "CALLS = Path(__file__).parents[1] / 'calls'\n"
        "class Metrics:\n"
        "    def block_until_ready(self):\n"
        "        with open(CALLS, 'a') as f:\n"
        "            print('ready', file=f)\n"
        "def make_step_inputs(cfg, rows, src_len, tgt_len):\n"
        "    def step(state, batch):\n"
        "        with open(CALLS, 'a') as f:\n"
        "            print(*cfg, rows, src_len, tgt_len, state, file=f)\n"
        "        return state + 1, Metrics()\n"
        "    return step, 0, None\n"
    )
    return folder


def test_ab_step_builds_the_step_of_the_revision_given_and_gives_back_the_callers_modules(
    tmp_path,
):
    import train
    import transformer

    folder = fake_revision(tmp_path / "rev", "the revision's")
    with ab_step.imported_from(folder):
        import train as their_train
        import transformer as theirs

        importlib.import_module("transformer.only_here")

        # not this checkout's, imported before
        assert theirs.MARKER == their_train.MARKER == "the revision's"
    assert sys.modules["transformer"] is transformer and not hasattr(transformer, "MARKER")
    assert sys.modules["train"] is train and "transformer.only_here" not in sys.modules
    assert "benchmarks.train_speed" not in sys.modules or (
        sys.modules["benchmarks.train_speed"] is train_speed
    )

    run = ab_step.build_step(folder, "tiny", 123, rows=6, length=7, warmup=2)
    # Compiling (the first call) and 2 warm-up steps happen when it is built; each call
    # then runs one more step from the state the last one left, and waits for it to end.
    calls = folder / "calls"
    steps = [[f"tiny 123 6 7 7 {state}", "ready"] for state in range(4)]
    assert calls.read_text().splitlines() == [*steps[0], *steps[1], *steps[2]]
    run()
    assert calls.read_text().splitlines()[6:] == steps[3]


def test_ab_step_exports_a_revision_named_with_a_slash_into_one_folder(tmp_path):
    if not in_git_checkout():
        pytest.skip("needs the git checkout's history")
    # origin/main would be one; a tree of HEAD's is one that every checkout has.
    folder = ab_step.export_revision("HEAD:benchmarks/results", tmp_path, 1)
    assert folder == tmp_path / "1_HEAD:benchmarks_results" and any(folder.iterdir())


def test_ab_step_prints_the_median_step_of_each_revision_alternating_their_order(
    tmp_path, monkeypatch, capsys, ab_step_keeps_malloc_as_it_is
):
    import train
    from transformer.host_memory import accelerator_expected, uses_glibc

    now, calls, built = [0.0], [], []
    step_ms = {"A": iter([3, 2, 2, 9]), "B": iter([1, 5, 2, 1])}

    def export_revision(revision, into, position):
        folder = tmp_path / f"{position}_{revision}"
        (folder / "benchmarks").mkdir(parents=True)
        (folder / "benchmarks" / "train_speed.py").write_text("")
        return folder

    def build_step(folder, preset, vocab_size, rows, length, warmup):
        name = folder.name[-1]
        built.append((folder, preset, vocab_size, rows, length, warmup))

        def run():
            calls.append(name)
            now[0] += next(step_ms[name]) / 1000

        return run

    monkeypatch.setattr(ab_step, "export_revision", export_revision)
    monkeypatch.setattr(ab_step, "build_step", build_step)
    monkeypatch.setattr(ab_step, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    ab_step.main(["A", "B", "--preset", "tiny", "--rows", "2", "--rounds", "4", "--warmup", "0"])
    # Each revision's step from its own files, with the checkout's default vocabulary.
    vocab_size = train.DATA_DEFAULTS["vocab_size"]
    assert built == [
        (tmp_path / f"{i}_{r}", "tiny", vocab_size, 2, 16, 0) for i, r in enumerate("AB")
    ]
    assert calls == list("ABBAABBA")
    # A took 3, 2, 2 and 9 ms, B 1, 5, 2 and 1 ms: medians 2.5 and 1.5; B faster in the
    # 1st and 4th rounds (a tie is not faster).
    assert capsys.readouterr().out.splitlines() == [
        "A: built, compiled and warmed up in 0.0 s",
        "B: built, compiled and warmed up in 0.0 s",
        "tiny, 2 x (16 + 16) tokens, 4 alternating rounds:",
        "  A: median 2.5 ms/step (min 2.0)",
        "  B: median 1.5 ms/step (min 1.0)",
        "  B / A: 0.600; B faster in 2 of 4 rounds",
    ]
    # The malloc setting the train step is timed under (where it applies).
    asked = uses_glibc() and not accelerator_expected()
    assert bool(ab_step_keeps_malloc_as_it_is) == asked
