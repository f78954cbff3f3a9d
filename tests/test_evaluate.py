"""evaluate.py end to end on a tiny workdir: sacreBLEU agreement, --translate, plots, errors."""

import argparse
import io
import json
import os
import pty
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np
import pytest
import sacrebleu
from matplotlib import image as mpimg

import data
import evaluate
import train
from data.batching import inference_length
from tests.make_tiny_workdir import damage_checkpoint
from transformer import TransformerConfig, checkpoints, training, translate

N_TEST = 16
FAST = ["--beam", "2", "--max-extra-len", "4", "--no-progress"]


@pytest.fixture(scope="module")
def workdir(multi30k_dir, tmp_path_factory) -> Path:
    """A workdir written by train.py: 400 steps of the tiny preset on 300 Multi30k pairs.

    Enough for outputs that share words with the references ("Ein Mann in
    einem ..."), so the scores compared with sacreBLEU are not all zero.
    Checkpoints at steps 200, 300 and 400; none was scored, so "best" is 400.
    """
    root = tmp_path_factory.mktemp("eval")
    data_dir = root / "data"
    data_dir.mkdir()
    for split, n in (("train", 300), ("val", 16), ("test2016", N_TEST)):
        for lang in ("en", "de"):
            lines = (multi30k_dir / f"{split}.{lang}").read_bytes().split(b"\n")[:n]
            (data_dir / f"{split}.{lang}").write_bytes(b"\n".join(lines) + b"\n")
    run = root / "run"
    flags = ["--workdir", run, "--dataset", "files", "--data-dir", data_dir, "--preset", "tiny"]
    flags += ["--vocab-size", "400", "--max-len", "64", "--max-tokens", "1024", "--max-shapes", "1"]
    flags += ["--steps", "400", "--checkpoint-every", "100", "--keep-checkpoints", "3"]
    flags += ["--warmup-steps", "50", "--lr-scale", "0.3", "--dropout-rate", "0"]
    flags += ["--eval-every", "0", "--bleu-every", "0", "--log-every", "100", "--no-progress"]
    assert train.main([str(f) for f in flags]) == 0
    assert checkpoints.checkpoint_steps(run) == [200, 300, 400]
    return run


def _run(argv, capsys) -> tuple[int, str, str]:
    code = evaluate.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _piped_stdin(raw: bytes) -> types.SimpleNamespace:
    """sys.stdin as a pipe makes it: these bytes, and no terminal."""
    return types.SimpleNamespace(buffer=io.BytesIO(raw), isatty=lambda: False)


def _score_text(out: str, name: str) -> str:
    """What follows "NAME|signature = " in evaluate.py's output."""
    line = next(line for line in out.splitlines() if line.startswith(name + "|"))
    return line.split(" = ", 1)[1]


def test_printed_scores_equal_the_sacrebleu_command(workdir, tmp_path, capsys):
    hyp = tmp_path / "test2016.hyp"
    code, out, err = _run(
        ["--workdir", workdir, "--split", "test2016", "--output", hyp, *FAST], capsys
    )
    assert code == 0, err
    # By default the average of the last 5 checkpoints, here all 3 the run has; the header
    # names the split with its direction and size.
    assert "average of steps 200, 300, 400; test2016 en-de: 16 sentences;" in err
    hypotheses = hyp.read_text(encoding="utf-8").split("\n")[:-1]
    assert len(hypotheses) == N_TEST and len(set(hypotheses)) > 1
    assert "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in out
    ref = Path(json.loads((workdir / "config.json").read_text())["data"]["data_dir"])
    cli = subprocess.run(
        [Path(sys.executable).parent / "sacrebleu", ref / "test2016.de", "-i", hyp]
        + ["-m", "bleu", "chrf", "-w", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    expected = {m["name"]: m for m in json.loads(cli.stdout)}
    bleu = expected["BLEU"]
    # Score, n-gram precisions, brevity penalty and lengths all agree.
    assert _score_text(out, "BLEU") == f"{bleu['score']:.2f} {bleu['verbose_score']}"
    assert _score_text(out, "chrF2") == f"{expected['chrF2']['score']:.2f}"
    assert float(bleu["verbose_score"].split("/")[0]) > 0 and expected["chrF2"]["score"] > 0


def _copy_reading_other_data(workdir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the trained run whose config.json names an empty data folder of its own,
    for a test to write splits into; returns the copy and the folder."""
    run, data_dir = tmp_path / "run", tmp_path / "data"
    shutil.copytree(workdir, run)
    data_dir.mkdir()
    config = json.loads((run / "config.json").read_text())
    config["data"]["data_dir"] = str(data_dir)
    (run / "config.json").write_text(json.dumps(config))
    return run, data_dir


def test_scores_are_against_the_raw_reference_file_not_its_normalized_text(
    workdir, tmp_path, capsys
):
    # Normalizing changes no line of test2016.de, so scoring the normalized references
    # passed the test above. Here every reference is full-width (which NFKC undoes).
    run, data_dir = _copy_reading_other_data(workdir, tmp_path)
    origin = Path(json.loads((workdir / "config.json").read_text())["data"]["data_dir"])
    shutil.copy(origin / "test2016.en", data_dir / "test2016.en")
    wide = {c: chr(ord(c) + 0xFEE0) for c in map(chr, range(0x21, 0x7F))}
    raw = [line.translate(str.maketrans(wide)) for line in data.read_lines(origin / "test2016.de")]
    (data_dir / "test2016.de").write_text("".join(line + "\n" for line in raw), encoding="utf-8")
    hyp = tmp_path / "hyp"
    argv = ["--workdir", run, "--split", "test2016", "--output", hyp, "--checkpoint", "last"]
    code, out, err = _run([*argv, "--greedy", "--max-extra-len", "4", "--no-progress"], capsys)
    assert code == 0, err
    hypotheses = data.read_lines(hyp)
    chrf = f"{sacrebleu.corpus_chrf(hypotheses, [raw]).score:.2f}"
    normalized = [data.normalize(line) for line in raw]
    assert chrf != f"{sacrebleu.corpus_chrf(hypotheses, [normalized]).score:.2f}"
    assert _score_text(out, "chrF2") == chrf


def test_a_splits_empty_line_is_translated_not_skipped(workdir, tmp_path, capsys):
    # Training skips a pair with an empty side; a scored split keeps every line, so that
    # the translations line up with the reference file (and --output with the source).
    run, data_dir = _copy_reading_other_data(workdir, tmp_path)
    (data_dir / "test2016.en").write_text("A man rides a bike.\n\nTwo dogs play.\n")
    (data_dir / "test2016.de").write_text("Ein Mann fährt Rad.\nLeer.\nZwei Hunde spielen.\n")
    hyp = tmp_path / "hyp"
    argv = ["--workdir", run, "--split", "test2016", "--output", hyp, "--checkpoint", "last"]
    code, out, err = _run([*argv, "--greedy", *FAST[2:]], capsys)
    assert code == 0 and "test2016 en-de: 3 sentences;" in err, err
    translations = hyp.read_text(encoding="utf-8").split("\n")
    assert len(translations) == 4 and translations[1] == translations[3] == ""
    assert "BLEU|" in out


def test_the_search_flags_and_their_documented_defaults_reach_the_search(
    workdir, tmp_path, capsys, monkeypatch
):
    # The header printed the flags; the search must get them too.
    calls, bars = [], []
    real = evaluate.translate_ids
    names = ("greedy", "beam_size", "alpha", "max_extra_len", "max_tokens")

    def recording(*args, **kwargs):
        calls.append({name: kwargs[name] for name in names})
        bars.append(kwargs["progress"])
        return real(*args, **{**kwargs, "greedy": True, "max_extra_len": 1})  # quick

    monkeypatch.setattr(evaluate, "translate_ids", recording)
    src = tmp_path / "src.en"
    src.write_text("A dog runs.\n", encoding="utf-8")
    base = ["--workdir", workdir, "--src-file", src, "--output", tmp_path / "hyp", "--no-progress"]
    search = ["--beam", "3", "--alpha", "0.5", "--max-extra-len", "7", "--max-tokens", "512"]
    for flags in ([], search, ["--greedy"]):
        code, _, err = _run([*base, *flags], capsys)
        assert code == 0, err
    assert bars == [False] * 3  # --no-progress each time
    assert calls == [
        dict(greedy=False, beam_size=5, alpha=1.25, max_extra_len=50, max_tokens=4096),
        dict(greedy=False, beam_size=3, alpha=0.5, max_extra_len=7, max_tokens=512),
        dict(greedy=True, beam_size=5, alpha=1.25, max_extra_len=50, max_tokens=4096),
    ]


def test_the_validation_bleu_of_training_is_evaluate_pys_greedy_score(workdir, capsys):
    # train.py keeps the checkpoint with the best of these scores: they must be real
    # sacreBLEU of greedy translations, as evaluate.py --greedy prints it.
    data_dir = Path(json.loads((workdir / "config.json").read_text())["data"]["data_dir"])
    val = data.load_corpus(
        data.CorpusSpec(dataset="files", data_dir=str(data_dir)), "val", clean=False
    )
    run = translate.load_run(workdir, checkpoint="last")
    references = data.read_lines(data_dir / "val.de")
    bleu = training.evaluate_bleu(run.model, run.params, run.tokenizer, val.src, references)
    argv = ["--workdir", workdir, "--split", "val", "--checkpoint", "last", "--greedy"]
    code, out, err = _run([*argv, "--no-progress"], capsys)
    assert code == 0, err
    assert bleu > 0 and _score_text(out, "BLEU").split()[0] == f"{bleu:.2f}"


def test_identical_hypotheses_score_100(multi30k_dir):
    references = data.read_lines(multi30k_dir / "test2016.de")[:50]
    lines = evaluate.score(references, references)
    assert [line.split(" = ")[1].split()[0] for line in lines] == ["100.00", "100.00"]


def test_translate_keeps_one_line_per_line(workdir, tmp_path, capsys, monkeypatch):
    lines = ["A man rides a bike.", "", "Two dogs play in the snow.", "   ", ""]
    source = tmp_path / "in.en"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = ["--workdir", workdir, "--translate", "--checkpoint", "300", *FAST]
    code, out, err = _run([*args, "--input", source], capsys)
    assert code == 0, err
    assert "step 300;" in err
    translations = out.split("\n")
    assert translations[-1] == "" and len(translations) - 1 == len(lines)
    assert [t == "" for t in translations[:-1]] == [False, True, False, True, True]

    monkeypatch.setattr(sys, "stdin", _piped_stdin(source.read_bytes()))
    code, stdin_out, _ = _run(args, capsys)
    assert code == 0 and stdin_out == out


def test_translate_at_a_terminal_answers_each_line_as_it_is_typed(
    workdir, tmp_path, capsys, repo_root, users_environment
):
    # Read to its end first, typed lines were translated only after Ctrl-D.
    lines = ["A man rides a bike.", "Two dogs play in the snow."]
    source = tmp_path / "in.en"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = ["--workdir", workdir, "--translate", "--checkpoint", "300", *FAST]
    code, expected, err = _run([*args, "--input", source], capsys)
    assert code == 0, err
    terminal, child_side = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "evaluate.py", *map(str, args)], cwd=repo_root, env=users_environment,
        stdin=child_side, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    os.close(child_side)
    try:
        answers = []
        # Latin-1 between the two: its error, and the next line is still read.
        for typed, line in zip([b"", b"caf\xe9\n"], lines, strict=True):
            os.write(terminal, typed + line.encode() + b"\n")
            readable = select.select([process.stdout], [], [], 120)[0]
            assert readable, f"no translation of {line!r} within 120 s"
            answers.append(process.stdout.readline().decode())
            assert process.poll() is None  # answered while the terminal is still open
        os.write(terminal, b"\x04")  # Ctrl-D at the start of a line: the input's end
        assert process.wait(timeout=60) == 0, process.stderr.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
        os.close(terminal)
    assert "".join(answers) == expected and process.stdout.read() == b""
    err = process.stderr.read().decode()
    assert "; translating each line typed, until Ctrl-D" in err
    assert (
        "\nerror: standard input, line 2: invalid UTF-8 (invalid continuation byte at byte 3)"
        in err
    )


def test_the_progress_bar_is_drawn_at_a_terminal_only(workdir, tmp_path, capsys, monkeypatch):
    source = tmp_path / "in.en"
    source.write_text("A man rides a bike.\n", encoding="utf-8")
    args = ["--workdir", workdir, "--translate", "--input", source, "--checkpoint", "300"]
    args += ["--beam", "2", "--max-extra-len", "4"]  # FAST without its --no-progress
    code, out, err = _run(args, capsys)  # stderr is pytest's capture: a log file, say
    assert code == 0 and "decoding" not in err and "\r" not in err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, bar_out, err = _run(args, capsys)
    assert code == 0 and "\rdecoding: 100%" in err and bar_out == out
    code, _, err = _run([*args, "--no-progress"], capsys)
    assert code == 0 and "decoding" not in err


def test_average_last_and_src_file(workdir, tmp_path, capsys):
    src = tmp_path / "src.en"
    src.write_text("A man rides a bike.\nA woman sings.\n", encoding="utf-8")
    hyp = tmp_path / "hyp.de"
    argv = ["--workdir", workdir, "--src-file", src, "--greedy", *FAST[2:], "--output", hyp]
    code, out, err = _run([*argv, "--average-last", "2"], capsys)
    assert code == 0, err
    assert "average of steps 300, 400;" in err
    assert "BLEU" not in out  # nothing to score without --ref-file
    # The file holds the averaged parameters' greedy translations of the file's lines.
    run = translate.load_run(workdir, average_last=2)
    expected = translate.translate(
        run.model, run.params, run.tokenizer, src.read_text(encoding="utf-8").splitlines(),
        greedy=True, max_extra_len=4,
    )  # fmt: skip
    assert hyp.read_text(encoding="utf-8").splitlines() == expected
    code, _, err = _run([*argv, "--checkpoint", "best"], capsys)
    # No step was scored, so "best" is the newest, and the header says so (it said "best").
    assert code == 0 and "step 400 (the newest: no checkpoint has a validation BLEU);" in err


def test_output_dash_prints_the_translations_and_moves_the_scores_to_stderr(
    workdir, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # where a file named "-" would land
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("A man rides a bike.\nA woman sings.\nTwo dogs play.\n", encoding="utf-8")
    ref.write_text("Ein Mann fährt Rad.\nEine Frau singt.\nZwei Hunde spielen.\n", encoding="utf-8")
    hyp = tmp_path / "hyp.de"
    argv = ["--workdir", workdir, "--src-file", src, "--ref-file", ref, *FAST]
    code, file_out, err = _run([*argv, "--output", hyp], capsys)
    assert code == 0, err
    code, out, err = _run([*argv, "--output", "-"], capsys)
    assert code == 0, err
    assert out == hyp.read_text(encoding="utf-8")  # the translations alone, as in the file
    assert _score_text(err, "BLEU") == _score_text(file_out, "BLEU")
    assert _score_text(err, "chrF2") == _score_text(file_out, "chrF2")
    assert not (tmp_path / "-").exists()
    # --translate --output FILE writes both the file and stdout; "-" would print twice.
    translate_argv = ["--workdir", workdir, "--translate", "--input", src, *FAST]
    code, out, err = _run([*translate_argv, "--output", tmp_path / "t.de"], capsys)
    assert code == 0 and out == hyp.read_text(encoding="utf-8") == (tmp_path / "t.de").read_text()
    code, out, err = _run([*translate_argv, "--output", "-"], capsys)
    assert code == 2 and out == ""
    assert err == "error: --translate prints the translations already: drop --output -\n"


def test_src_file_with_nowhere_for_the_translations_is_an_error_before_decoding(
    workdir, tmp_path, capsys
):
    src = tmp_path / "src.en"
    src.write_text("A man rides a bike.\n", encoding="utf-8")
    code, out, err = _run(["--workdir", workdir, "--src-file", src, *FAST], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: --src-file alone would translate into nothing: add --output")


def test_sources_longer_than_max_len_are_translated_whole_with_a_warning(workdir, tmp_path, capsys):
    src = tmp_path / "src.en"
    src.write_text("A man rides a bike.\n" + "A man " * 60 + "\n", encoding="utf-8")
    hyp = tmp_path / "hyp.de"
    argv = ["--workdir", workdir, "--src-file", src, "--greedy", *FAST[2:], "--output", hyp]
    code, _, err = _run(argv, capsys)
    hypotheses = hyp.read_text(encoding="utf-8").splitlines()
    assert code == 0 and len(hypotheses) == 2
    [warning] = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert warning.startswith(
        "warning: source lines longer than the model's max_len of 64 tokens: 1 ("
    )
    # Whole: as the library translates the full line (cut to max_len, it came out shorter).
    run = translate.load_run(workdir)
    long_line = src.read_text(encoding="utf-8").splitlines()[1]
    whole = translate.translate(
        run.model, run.params, run.tokenizer, [long_line], greedy=True, max_extra_len=4
    )
    assert hypotheses[1] == whole[0]


def test_sources_as_long_as_max_len_get_no_warning(capsys):
    evaluate._warn_of_long_sources([[5] * 64, [5] * 3], max_len=64)
    assert capsys.readouterr().err == ""
    evaluate._warn_of_long_sources([[5] * 64, [5] * 65], max_len=64)
    assert "max_len of 64 tokens: 1 (the longest 65 tokens)" in capsys.readouterr().err


def test_ctrl_c_while_decoding_is_one_line_exit_130_and_no_output(
    workdir, tmp_path, capsys, monkeypatch
):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "translate_ids", interrupted)
    hyp = tmp_path / "hyp.de"
    code, out, err = _run(["--workdir", workdir, "--split", "val", *FAST, "--output", hyp], capsys)
    assert code == 130 and out == "" and not hyp.exists()
    assert err.splitlines()[-1] == f"interrupted; --output {hyp} was not written"


def test_a_ctrl_c_that_python_dropped_still_stops_before_the_output_is_written(
    workdir, tmp_path, capsys, monkeypatch
):
    # Python drops what a garbage-collection callback raises, and JAX runs one: 4 of 19
    # Ctrl-Cs went so, decoding went on, overwrote --output and exited 0.
    def ctrl_c_dropped(model, params, src_ids, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(200):  # the handler runs between bytecodes, soon
                time.sleep(0.01)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("SIGINT did not raise KeyboardInterrupt")
        return [[] for _ in src_ids]

    monkeypatch.setattr(evaluate, "translate_ids", ctrl_c_dropped)
    hyp = tmp_path / "hyp.de"
    hyp.write_text("the translations of before\n", encoding="utf-8")
    # Python's own handler, or SIG_IGN where the suite runs as a background job (`cmd &`)
    before = signal.getsignal(signal.SIGINT)
    code, out, err = _run(["--workdir", workdir, "--split", "val", *FAST, "--output", hyp], capsys)
    assert code == 130 and out == "", err
    assert err.splitlines()[-1] == f"interrupted; --output {hyp} was not written"
    assert hyp.read_text(encoding="utf-8") == "the translations of before\n"
    assert signal.getsignal(signal.SIGINT) is before  # put back


def test_ctrl_c_after_the_output_is_written_does_not_say_it_was_not(
    workdir, tmp_path, capsys, monkeypatch
):
    def interrupted(hypotheses, references):  # while scoring, after --output was written
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "score", interrupted)
    src, ref, hyp = tmp_path / "src.en", tmp_path / "ref.de", tmp_path / "hyp.de"
    src.write_text("A dog runs.\n", encoding="utf-8")
    ref.write_text("Ein Hund rennt.\n", encoding="utf-8")
    argv = ["--workdir", workdir, "--src-file", src, "--ref-file", ref, "--output", hyp]
    code, out, err = _run([*argv, "--greedy", *FAST[2:]], capsys)
    assert code == 130 and out == "" and err.splitlines()[-1] == "interrupted", err
    assert len(hyp.read_text(encoding="utf-8").splitlines()) == 1


def test_output_to_dev_stdout_is_written_through_stdout_with_the_scores_on_stderr(
    workdir, tmp_path, repo_root
):
    # Through a pipe the scores came after the translations; with stdout sent to a file
    # (`>> log`), that file was replaced: what it held before and the scores were lost.
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("A man rides a bike.\nTwo dogs play.\n", encoding="utf-8")
    ref.write_text("Ein Mann fährt Rad.\nZwei Hunde spielen.\n", encoding="utf-8")
    argv = [sys.executable, "evaluate.py", "--workdir", workdir, "--src-file", src]
    argv += ["--ref-file", ref, "--greedy", *FAST[2:], "--output", "/dev/stdout"]
    argv = [str(a) for a in argv]
    piped = subprocess.run(argv, cwd=repo_root, capture_output=True, text=True)
    assert piped.returncode == 0, piped.stderr
    assert len(piped.stdout.splitlines()) == 2 and "BLEU|" in piped.stderr, piped.stdout
    log = tmp_path / "log.txt"
    log.write_text("what the log held before\n", encoding="utf-8")
    with open(log, "a", encoding="utf-8") as appended:
        result = subprocess.run(argv, cwd=repo_root, stdout=appended, stderr=subprocess.PIPE)
    assert result.returncode == 0, result.stderr
    assert log.read_text(encoding="utf-8") == "what the log held before\n" + piped.stdout
    assert b"BLEU|" in result.stderr


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_output_folder_that_cannot_be_written_is_an_error_before_decoding(workdir, capsys):
    # Not even root can make a file in /proc; the error names --output, not a temporary file.
    argv = ["--workdir", workdir, "--split", "val", *FAST, "--output", "/proc/hyp.de"]
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: --output /proc/hyp.de: cannot write there (")


def test_a_damaged_newest_checkpoint_is_named_in_the_header_of_last_and_best(
    workdir, tmp_path, capsys
):
    run = tmp_path / "run"
    shutil.copytree(workdir, run)
    damage_checkpoint(run / "checkpoints" / "400")
    src = tmp_path / "src.en"
    src.write_text("A man rides a bike.\n", encoding="utf-8")
    argv = [
        "--workdir",
        run,
        "--src-file",
        src,
        "--greedy",
        *FAST[2:],
        "--output",
        tmp_path / "hyp",
    ]
    for which, label in [
        ("last", "the newest readable: the last, step 400, is damaged"),
        ("best", "the newest readable: no checkpoint has a validation BLEU"),
    ]:
        code, _, err = _run([*argv, "--checkpoint", which], capsys)
        assert code == 0, err
        assert "step 400" in err and f"step 300 ({label});" in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_is_one_line_that_promises_no_training(workdir, tmp_path, capsys):
    (tmp_path / "in.en").write_text("A dog runs.\n")
    argv = ["--workdir", workdir, "--translate", "--input", tmp_path / "in.en"]
    code, out, err = _run([*argv, "--output", "/dev/full", *FAST], capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == (
        "error: /dev/full: No space left on device; make room there and run the same command again"
    )


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs a file size limit")
def test_a_failed_write_of_output_keeps_the_old_translations_whole(workdir, tmp_path, capsys):
    # A file size limit (as a quota gives) lets a write stop part way, whoever writes: the
    # old file must stay as it was, not be cut to the part of the new one that fitted.
    hyp = tmp_path / "hyp.de"
    hyp.write_text("the translations of before\n", encoding="utf-8")
    argv = ["--workdir", workdir, "--split", "val", "--greedy", *FAST[2:], "--output", hyp]
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a killed process
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, limits[1]))
        code, out, err = _run([*argv, "--no-compilation-cache"], capsys)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    assert hyp.read_text(encoding="utf-8") == "the translations of before\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hyp.de"]  # no temporary file left
    assert code == 2 and out == "", err
    assert err.splitlines()[-1] == f"error: {hyp}: File too large", err


def test_attention_plots_are_png_files(workdir, tmp_path, capsys):
    plot_dir = tmp_path / "plots"
    argv = ["--workdir", workdir, "--split", "test2016", *FAST]
    code, _, err = _run(
        [*argv, "--plot-attention", "2", "--plot-dir", plot_dir, "--plot-heads"], capsys
    )
    assert code == 0, err
    layers = TransformerConfig.preset("tiny", vocab_size=8).num_decoder_layers
    files = sorted(plot_dir.glob("*.png"))
    assert [f.name for f in files] == sorted(
        f"sentence_{i:04d}_layer{layer}{kind}.png"
        for i in (1, 2)
        for layer in range(1, layers + 1)
        for kind in ("", "_heads")
    )
    for f in files:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = mpimg.imread(f)
        assert pixels.ndim == 3 and min(pixels.shape[:2]) > 200
        assert pixels.std() > 0.05  # not a blank canvas


def test_attention_plots_show_the_first_non_empty_lines_and_each_output_with_its_end(
    workdir, tmp_path, capsys, monkeypatch
):
    from transformer import visualize

    decoded, drawn = [], []
    real_search, real_plot = evaluate.translate_ids, visualize.plot_sentence_attention

    def recording_search(model, params, src_ids, **kwargs):
        decoded.append((src_ids, real_search(model, params, src_ids, **kwargs)))
        return decoded[-1][1]

    def recording_plot(layer_weights, src_tokens, tgt_tokens, out_dir, **kwargs):
        drawn.append((layer_weights, src_tokens, tgt_tokens))
        return real_plot(layer_weights, src_tokens, tgt_tokens, out_dir, **kwargs)

    monkeypatch.setattr(evaluate, "translate_ids", recording_search)
    monkeypatch.setattr(visualize, "plot_sentence_attention", recording_plot)
    src, plot_dir = tmp_path / "src.en", tmp_path / "plots"
    src.write_text("\nA dog runs in the snow.\n", encoding="utf-8")
    argv = ["--workdir", workdir, "--src-file", src, "--checkpoint", "last", "--greedy"]
    code, _, err = _run([*argv, *FAST[2:], "--plot-attention", "1", "--plot-dir", plot_dir], capsys)
    assert code == 0, err
    # An empty line has no attention to draw: the first plot is line 2's, named by its
    # number, and without --plot-heads only the mean over the heads is drawn.
    layers = TransformerConfig.preset("tiny", vocab_size=8).num_decoder_layers
    assert sorted(f.name for f in plot_dir.iterdir()) == [
        f"sentence_0002_layer{layer}.png" for layer in range(1, layers + 1)
    ]
    # Its rows are the translation's pieces and then its end, each the attention of the
    # decoder step (fed the start token, then the pieces before) that chose it.
    [(src_ids, hyp_ids)] = decoded
    [(layer_weights, src_tokens, tgt_tokens)] = drawn
    run = translate.load_run(workdir, checkpoint="last")
    tok = run.tokenizer
    tgt_out = [*hyp_ids[1], tok.eos_id]
    assert src_tokens == [tok.id_to_piece(t) for t in src_ids[1]]
    assert tgt_tokens == [tok.id_to_piece(t) for t in tgt_out]
    expected = visualize.cross_attention_weights(
        run.model, run.params, np.asarray([src_ids[1]]), np.asarray([tgt_out]), bos_id=tok.bos_id
    )
    assert len(layer_weights) == layers
    for weights, layer in zip(layer_weights, expected, strict=True):
        np.testing.assert_allclose(weights, layer[0], rtol=1e-5, atol=1e-6)


def test_training_curve_is_drawn_from_metrics(workdir, tmp_path, capsys):
    path = tmp_path / "curve.png"
    code, _, err = _run(["--workdir", workdir, "--plot-curve", path], capsys)
    assert code == 0, err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = mpimg.imread(path)
    assert min(pixels.shape[:2]) > 300 and pixels.std() > 0.05
    empty = tmp_path / "fresh_run"  # its config written, no record logged yet
    empty.mkdir()
    shutil.copy(workdir / "config.json", empty / "config.json")
    code, _, err = _run(["--workdir", empty, "--plot-curve", path], capsys)
    assert code == 2 and "no training records" in err


def test_training_curve_file_printed_is_the_file_written(workdir, tmp_path, capsys):
    # matplotlib itself would add .png to a bare name but report nothing.
    code, _, err = _run(["--workdir", workdir, "--plot-curve", tmp_path / "curve"], capsys)
    assert code == 0 and err == f"wrote {tmp_path / 'curve.png'}\n", err
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = _run(["--workdir", workdir, "--plot-curve", tmp_path / "sub" / "c.PNG"], capsys)
    assert code == 0 and err == f"wrote {tmp_path / 'sub' / 'c.PNG'}\n", err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["c.PNG", "curve.png", "sub"]


@pytest.mark.parametrize(
    "name, message",
    [
        ("{dir}", "--plot-curve {dir} names a directory"),  # matplotlib wrote {dir}.png
        ("{dir}/new/", "--plot-curve {dir}/new/ names a directory"),
        ("{dir}/curve.xyz", "--plot-curve {dir}/curve.xyz: the plot is a PNG"),  # blamed workdir
        ("{dir}/curve.pdf", "--plot-curve {dir}/curve.pdf: the plot is a PNG"),
        ("{dir}/a_file/curve.png", "--plot-curve {dir}/a_file/curve.png: {dir}/a_file is not a"),
    ],
    ids=["directory", "trailing-separator", "unknown-suffix", "other-format", "under-a-file"],
)
def test_training_curve_path_errors_name_the_path(name, message, workdir, tmp_path, capsys):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "a_file").write_text("not a directory\n")
    name, message = name.format(dir=out_dir), message.format(dir=out_dir)
    code, _, err = _run(["--workdir", workdir, "--plot-curve", name], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err and str(workdir) not in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a_file", "out"]  # nothing written


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workdir", "{missing}", "--split", "test2016"], "does not exist"),
        (
            ["--workdir", "{workdir}", "--split", "test2099"],
            "available splits: test2016, train, val",
        ),
        (
            ["--workdir", "{workdir}", "--split", "val", "--checkpoint", "7"],
            "no checkpoint at step 7",
        ),
        (["--workdir", "{workdir}", "--src-file", "{src}", "--ref-file", "{ref}"], "has 3 lines"),
        (
            ["--workdir", "{workdir}", "--src-file", "{empty_src}", "--ref-file", "{empty_ref}"],
            "{empty_src} and {empty_ref} are empty: nothing to score",
        ),
        (["--workdir", "{workdir}", "--split", "val", "--translate"], "exactly one of"),
        (
            ["--workdir", "{workdir}"],
            "choose exactly one of --split, --src-file, --translate or --plot-curve",
        ),
        (
            ["--workdir", "{workdir}", "--split", "val", "--ref-file", "{ref}"],
            "--ref-file needs --src-file",
        ),
        (
            ["--workdir", "{workdir}", "--split", "val", "--input", "{src}"],
            "--input goes with --translate (use --src-file to score a file)",
        ),
        (
            ["--workdir", "{workdir}", "--split", "val", "--average-last", "4"],
            "has 3 (200, 300, 400)",
        ),
        (
            [
                "--workdir",
                "{workdir}",
                "--split",
                "val",
                "--average-last",
                "2",
                "--checkpoint",
                "7",
            ],
            "not both",
        ),
        (["--workdir", "{workdir}", "--split", "val", "--average-last", "0"], "at least 1"),
        (["--workdir", "{workdir}", "--split", "val", "--alpha", "nan"], "finite number >= 0"),
        (["--workdir", "{workdir}", "--split", "val", "--alpha", "-1"], "finite number >= 0"),
        (["--workdir", "{workdir}", "--split", "val", "--alpha", "inf"], "finite number >= 0"),
        (["--workdir", "{workdir}", "--split", "val", "--beam", "0"], "--beam must be at least 1"),
        (
            ["--workdir", "{workdir}", "--split", "val", "--max-tokens", "0"],
            "--max-tokens must be at least 1",
        ),
        (["--workdir", "{workdir}", "--split", "val", "--max-extra-len", "-1"], "negative"),
        (
            ["--workdir", "{workdir}", "--split", "val", "--beam", "100000000000"],
            "--beam must be at most 1,048,576",
        ),
        (
            ["--workdir", "{workdir}", "--split", "val", "--max-extra-len", "3000000000"],
            "--max-extra-len must be at most 1,048,576",
        ),
        (
            ["--workdir", "{workdir}", "--split", "val", "--output", "{missing}/"],
            "--output {missing}/ is a directory; name a file",
        ),
        (["--workdir", "{workdir}", "--split", "val", "--plot-attention", "-1"], "negative"),
        (["--workdir", "{workdir}", "--split", "val", "--checkpoint", "\u00b2"], "a step number"),
        (
            ["--workdir", "{workdir}", "--split", "val", "--plot-dir", "{empty_dir}"],
            "--plot-dir is where --plot-attention N writes: add it, or drop --plot-dir",
        ),
        (
            ["--workdir", "{workdir}", "--split", "val", "--plot-heads"],
            "--plot-heads adds to --plot-attention N's plots",
        ),
        (["--workdir", "{src}", "--split", "val"], "workdir {src} is a file, not a directory"),
        (["--workdir", "{src}", "--plot-curve", "{ref}.png"], "{src} is a file, not a directory"),
        (
            ["--workdir", "{missing}", "--plot-curve", "{ref}.png"],
            "--workdir {missing} does not exist; train into it with train.py first",
        ),
        (
            ["--workdir", "{empty_dir}", "--plot-curve", "{ref}.png"],
            "{empty_dir} has no config.json or metrics.jsonl; is it a workdir written by",
        ),
    ],
    ids=[
        "missing-workdir",
        "unknown-split",
        "missing-step",
        "line-mismatch",
        "empty-files",
        "two-modes",
        "no-mode",
        "ref-file-without-src-file",
        "input-without-translate",
        "avg",
        "avg-and-checkpoint",
        "avg-0",
        "alpha-nan",
        "alpha-negative",
        "alpha-inf",
        "beam-0",
        "max-tokens-0",
        "max-extra-len-negative",
        "beam-past-int32",
        "max-extra-len-past-int32",
        "output-names-a-new-directory",
        "plot-attention-negative",
        "checkpoint-superscript-digit",
        "plot-dir-without-plots",
        "plot-heads-without-plots",
        "workdir-is-a-file",
        "curve-workdir-is-a-file",
        "curve-missing-workdir",
        "curve-workdir-without-metrics",
    ],
)
def test_user_errors_are_one_line_and_exit_2(argv, message, workdir, tmp_path, capsys):
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("a\nb\n", encoding="utf-8")
    ref.write_text("a\nb\nc\n", encoding="utf-8")
    empty_src, empty_ref = tmp_path / "empty.en", tmp_path / "empty.de"
    empty_src.write_bytes(b"")
    empty_ref.write_bytes(b"")
    (tmp_path / "empty_dir").mkdir()
    paths = dict(
        empty_dir=tmp_path / "empty_dir",
        missing=tmp_path / "nope",
        workdir=workdir,
        src=src,
        ref=ref,
        empty_src=empty_src,
        empty_ref=empty_ref,
    )
    code, out, err = _run([a.format(**paths) for a in argv], capsys)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message.format(**paths) in err, err


@pytest.mark.parametrize(
    "stream, argv, message",
    [
        ("stdin", ["--translate"], "standard input is closed"),
        ("stdout", ["--translate"], "standard output is closed"),
        ("stdout", ["--split", "val", "--output", "-"], "standard output is closed"),
    ],
)
def test_a_closed_standard_stream_is_a_one_line_error(
    stream, argv, message, workdir, monkeypatch, capsys
):
    # A shell's `<&-` or `>&-` leaves Python's sys.stdin or sys.stdout None.
    monkeypatch.setattr(sys, stream, None)
    code = evaluate.main(["--workdir", str(workdir), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_translate_input_file_needs_no_standard_input(workdir, tmp_path, monkeypatch, capsys):
    # As from cron or `<&-`: --input is read, and standard input never is.
    monkeypatch.setattr(sys, "stdin", None)
    source = tmp_path / "in.en"
    source.write_text("A dog runs.\n", encoding="utf-8")
    argv = ["--workdir", workdir, "--translate", "--input", source, "--greedy", *FAST[2:]]
    code, out, err = _run(argv, capsys)
    assert code == 0 and len(out.splitlines()) == 1, err


def test_the_least_values_of_the_search_flags_are_accepted():
    # Beam 1, no length penalty, no extra length, no plots and one checkpoint are settings,
    # not mistakes.
    least = ["--beam", "1", "--alpha", "0", "--max-extra-len", "0", "--max-tokens", "1"]
    least += ["--plot-attention", "0", "--average-last", "1"]
    args = evaluate.parse_args(["--workdir", "w", "--split", "val", *least])
    evaluate._check_args(args)
    assert (args.beam, args.alpha, args.max_extra_len, args.max_tokens) == (1, 0.0, 0, 1)


def test_the_largest_search_sizes_are_accepted():
    # The most that the error message names is a setting too.
    largest = str(evaluate.LARGEST_SEARCH_SIZE)
    argv = ["--workdir", "w", "--split", "val", "--beam", largest, "--max-extra-len", largest]
    evaluate._check_args(evaluate.parse_args(argv))


def _run_config(workdir: Path, **sections) -> Path:
    """A workdir holding only a config.json of these sections (a model section added)."""
    workdir.mkdir()
    (workdir / "config.json").write_text(json.dumps({"model": {}, **sections}))
    return workdir


def test_an_empty_split_is_an_error_not_a_crash(tmp_path):
    # sacreBLEU raises IndexError on an empty corpus; the split's files are named instead.
    for lang in ("en", "de"):
        (tmp_path / f"test2016.{lang}").write_bytes(b"")
    run = _run_config(tmp_path / "run", data={"dataset": "files", "data_dir": str(tmp_path)})
    args = evaluate.parse_args(["--workdir", str(run), "--split", "test2016"])
    with pytest.raises(
        data.DataError, match="split test2016 is empty .*test2016.en and .*test2016.de"
    ):
        evaluate.load_sources_and_references(args, run)


def _no_decoding(args):
    raise AssertionError("a bad output place must be reported before the model is loaded")


def test_input_mistakes_are_found_before_the_checkpoints_are_read(tmp_path, capsys):
    # They waited for the checkpoints to be read and averaged (minutes for a large model).
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("a\nb\n", encoding="utf-8")
    ref.write_text("a\n", encoding="utf-8")
    run = _run_config(tmp_path / "run", data={"dataset": "files", "data_dir": str(tmp_path)})
    for flags, message in (
        (["--src-file", tmp_path / "nope.en", "--output", tmp_path / "out"], "nope.en"),
        (["--src-file", src, "--ref-file", ref], "has 1 lines"),
        (["--split", "test2099"], "no split 'test2099'"),
    ):
        code = evaluate.main([str(a) for a in ["--workdir", run, *flags]], load=_no_decoding)
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert message in err, err


def test_a_mistyped_checkpoint_is_refused_before_the_inputs_are_read(tmp_path, capsys):
    # load_run refuses it too, but only after the inputs were read (a split perhaps
    # downloaded) and the model built: here the missing source file would be reported.
    argv = ["--workdir", tmp_path, "--src-file", tmp_path / "nope.en", "--output", tmp_path / "o"]
    code = evaluate.main([str(a) for a in [*argv, "--checkpoint", "lastt"]], load=_no_decoding)
    err = capsys.readouterr().err
    assert code == 2
    assert err == "error: --checkpoint must be 'best', 'last' or a step number, not 'lastt'\n"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--plot-attention", "1", "--plot-dir", "{file}"], "--plot-dir {file}: {file} is not a"),
        (
            ["--plot-attention", "1", "--plot-dir", "{file}/plots"],
            "--plot-dir {file}/plots: {file} is not a directory",
        ),
        (["--output", "{dir}"], "--output {dir} is a directory"),
        (["--output", "{file}/out.de"], "--output {file}/out.de: {file} is not a directory"),
        # The translations go to the file a link names (the link stays a link): its folder.
        (["--output", "{link}"], "--output {link}: {file} is not a directory"),
    ],
    ids=[
        "plot-dir-is-a-file",
        "plot-dir-under-a-file",
        "output-is-a-dir",
        "output-under-a-file",
        "output-links-under-a-file",
    ],
)
def test_unwritable_output_places_fail_before_decoding(flags, message, tmp_path, capsys):
    places = dict(file=tmp_path / "a_file", dir=tmp_path, link=tmp_path / "link.de")
    places["file"].write_text("not a directory\n")
    places["link"].symlink_to(places["file"] / "out.de")
    argv = ["--workdir", tmp_path, "--split", "val", *(f.format(**places) for f in flags)]
    code = evaluate.main([str(a) for a in argv], load=_no_decoding)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message.format(**places) in err, err


def test_ctrl_c_while_the_libraries_load_ends_the_command_in_one_line(
    tmp_path, run_ctrl_c_while_loading
):
    # It printed an import traceback, or JAX's garbage-collection callback dropped the
    # KeyboardInterrupt and the command went on.
    result = run_ctrl_c_while_loading("evaluate.py", "--workdir", tmp_path, "--split", "val")
    assert result.returncode == 130 and result.stderr == "interrupted\n", result.stderr


def test_a_reader_that_ended_is_one_line_and_the_status_of_sigpipe(
    workdir, tmp_path, repo_root, users_environment
):
    # `evaluate.py --translate ... | head -1`: it said "error: [Errno 32] Broken pipe", status
    # 2, where a command that a closed pipe ends gives 141.
    source = tmp_path / "in.en"
    source.write_text("A man rides a bike.\nTwo dogs play.\n", encoding="utf-8")
    argv = [sys.executable, "evaluate.py", "--workdir", workdir, "--translate", "--input"]
    argv += [source, "--checkpoint", "300", *FAST]
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has ended
    try:
        done = subprocess.run(
            [str(a) for a in argv], cwd=repo_root, env=users_environment, timeout=120,
            stdout=write_end, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert done.returncode == 128 + signal.SIGPIPE, done.stderr
    assert done.stderr.endswith(
        "\nerror: the output's reader ended before it was all written (a broken pipe)\n"
    )
    assert "Exception ignored" not in done.stderr


def test_cli_error_has_no_traceback(tmp_path, repo_root):
    result = subprocess.run(
        [sys.executable, "evaluate.py", "--workdir", str(tmp_path / "nope"), "--split", "val"],
        cwd=repo_root,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: workdir") and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda model: model.update(rotary=False), "bad model settings (unknown"),
        (lambda model: model.update(d_ff=2 * model["d_ff"]), "do not fit the model of its"),
        (lambda model: model.pop("d_model"), "do not fit the model of its"),  # the default
        (lambda model: model.update(vocab_size=model["vocab_size"] + 1), "pieces but the model of"),
    ],
    ids=["unknown-field", "other-shape", "missing-field", "other-vocabulary"],
)
def test_an_edited_config_is_a_one_line_error(edit, message, workdir, tmp_path, capsys):
    # Before: a ValueError traceback, or a Flax shape error from inside the jitted search.
    run = tmp_path / "run"
    shutil.copytree(workdir, run)
    config = json.loads((run / "config.json").read_text())
    edit(config["model"])
    (run / "config.json").write_text(json.dumps(config))
    source = tmp_path / "in.en"
    source.write_text("A dog.\n", encoding="utf-8")
    code, out, err = _run(["--workdir", run, "--translate", "--input", source, *FAST], capsys)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err and "config.json" in err, err  # (the test's folder says "config")


def test_a_run_whose_data_moved_or_is_not_recorded_is_a_data_error(tmp_path, monkeypatch):
    args = evaluate.parse_args(["--workdir", "unused", "--split", "val"])
    moved = _run_config(
        tmp_path / "moved", data={"dataset": "files", "data_dir": str(tmp_path / "x")}
    )
    with pytest.raises(data.DataError, match="the run's data directory .*x .* is not there"):
        evaluate.load_sources_and_references(args, moved)
    # No "data" section reads as the defaults (Multi30k; offline here), not a KeyError.
    from data import multi30k

    def offline(url, timeout=None):
        raise __import__("urllib.error").error.URLError("offline")

    monkeypatch.setattr(multi30k, "urlopen", offline)
    with pytest.raises(data.DataError, match="cannot download Multi30k"):
        evaluate.load_sources_and_references(args, _run_config(tmp_path / "no_data"))


@pytest.mark.parametrize("flag", ["--src-file", "--ref-file", "--input"])
def test_output_onto_an_input_file_is_refused_before_decoding(flag, tmp_path, capsys, monkeypatch):
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("a\n", encoding="utf-8")
    ref.write_text("b\n", encoding="utf-8")
    inputs = ["--src-file", src, "--ref-file", ref]
    if flag == "--input":
        inputs = ["--translate", "--input", src]
    # The same file spelled otherwise: the input's full path, the output's from here.
    monkeypatch.chdir(tmp_path)
    target = ref.name if flag == "--ref-file" else src.name
    argv = ["--workdir", tmp_path, *inputs, "--output", target]
    code = evaluate.main([str(a) for a in argv], load=_no_decoding)
    err = capsys.readouterr().err
    assert code == 2 and f"is the {flag} file" in err and err.count("\n") == 1, err
    assert src.read_text() == "a\n" and ref.read_text() == "b\n"


def test_output_onto_the_file_stdin_reads_is_refused_before_decoding(tmp_path, capsys, monkeypatch):
    # `evaluate.py --translate --output f < f`: the translations replaced the sources.
    src = tmp_path / "src.en"
    src.write_text("a\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    argv = ["--workdir", str(tmp_path), "--translate", "--output", src.name]
    with open(src, encoding="utf-8") as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        code = evaluate.main(argv, load=_no_decoding)
    err = capsys.readouterr().err
    assert code == 2 and err == (
        "error: --output src.en is the file standard input reads; name another file, or it "
        "would be overwritten\n"
    )
    assert src.read_text() == "a\n"
    # Another file, and a device such as /dev/null on both sides, are written as asked.
    for stdin_path, output in ((src, tmp_path / "out.de"), (os.devnull, os.devnull)):
        with open(stdin_path, encoding="utf-8") as stdin:
            monkeypatch.setattr(sys, "stdin", stdin)
            args = ["--workdir", str(tmp_path), "--translate", "--output", str(output)]
            evaluate._check_output_places(evaluate.parse_args(args))


@pytest.mark.parametrize(
    "flags, refused",
    [
        (["--split", "val", "--output", "{w}/config.json"], "--output {w}/config.json"),
        (["--split", "val", "--output", "{w}/tokenizer.model"], "--output {w}/tokenizer.model"),
        (["--split", "val", "--output", "{w}/checkpoints/4/x"], "--output {w}/checkpoints/4/x"),
        (["--split", "val", "--output", "{w}/events.out.tfevents.1.vm"], "--output {w}/events"),
        (["--plot-curve", "{w}/metrics.jsonl"], "--plot-curve {w}/metrics.jsonl"),
        (["--split", "val", "--plot-attention", "1", "--plot-dir", "{w}/cache"], "--plot-dir"),
    ],
    ids=["config", "tokenizer", "checkpoints", "events", "curve-on-metrics", "plots-in-cache"],
)
def test_output_onto_the_runs_own_files_is_refused_before_decoding(
    flags, refused, tmp_path, capsys
):
    # --output workdir/config.json wrote translations over the run's config: neither
    # evaluate.py nor train.py could use the workdir again.
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / "config.json").write_text("{}\n")
    argv = ["--workdir", workdir, *(f.format(w=workdir) for f in flags)]
    code = evaluate.main([str(a) for a in argv], load=_no_decoding)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {refused.format(w=workdir)}") and "the run keeps" in err, err
    assert (workdir / "config.json").read_text() == "{}\n"
    assert {train.CACHE_DIR, train.LOCK_FILE} <= set(checkpoints.RUN_ENTRIES)  # one list
    # Beside them, translations are welcome.
    beside = ["--workdir", str(workdir), "--split", "val", "--output", str(workdir / "val.hyp")]
    evaluate._check_output_places(evaluate.parse_args(beside))


def _ended_process_id() -> int:
    """The id of a process that has ended: a killed run's stale lock file holds one."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("under_way", [True, False], ids=["training", "killed"])
def test_a_run_that_has_saved_nothing_yet_is_waited_for_not_called_no_workdir(
    under_way, workdir, tmp_path, capsys
):
    # A user starts train.py, then evaluate.py in another terminal, while the run sets up
    # (its data and tokenizer: minutes at full size) or before its first checkpoint.
    assert checkpoints.LOCK_FILE == train.LOCK_FILE
    pid = os.getpid() if under_way else _ended_process_id()
    run = tmp_path / "run"
    run.mkdir()
    (run / train.LOCK_FILE).write_text(f"{pid}\n")  # as train.py writes it
    waiting = f"; train.py (process {pid}) is training in {run}: "
    first = waiting + "evaluate once it has saved its first checkpoint"

    def error(*flags: str | Path) -> str:
        code, out, err = _run(["--workdir", run, *flags], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1, (code, out, err)
        return err.removeprefix("error: ").rstrip("\n")

    def expect(got: str, plain: str, while_training: str) -> None:
        assert got == (while_training if under_way else plain), got

    # Setting up: nothing but the lock.
    curve = f"{run} has no config.json or metrics.jsonl"
    expect(
        error("--plot-curve", tmp_path / "c.png"),
        curve + "; is it a workdir written by train.py?",
        curve + waiting + "draw the curve once it has logged its first steps",
    )
    config = run / "config.json"
    expect(
        error("--split", "val"),
        f"{config} is missing; is {run} a workdir written by train.py?",
        f"{config} is not written yet" + first,
    )
    # Set up, no checkpoint yet.
    for name in ("config.json", "tokenizer.model"):
        shutil.copy(workdir / name, run / name)
    missing = f"no checkpoints in {run} ({run / 'checkpoints'} is missing)"
    expect(error("--split", "val"), missing, missing + first)
    (run / "checkpoints").mkdir()
    none = f"no checkpoints in {run / 'checkpoints'}"
    expect(error("--split", "val"), none + "; train with train.py first", none + first)
    # One checkpoint, and an average of two asked for.
    shutil.copytree(workdir / "checkpoints" / "200", run / "checkpoints" / "200")
    fewer = f"cannot average the last 2 checkpoints: {run} has 1 (200)"
    expect(
        error("--split", "val", "--average-last", "2"),
        fewer,
        fewer + waiting + "evaluate once it has saved 2, or average fewer",
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--output", "o.de"], "--plot-curve only draws the training curve: drop --output"),
        (["--checkpoint", "3"], "drop --checkpoint"),
        (["--average-last", "2"], "drop --average-last"),
        (["--plot-attention", "2"], "drop --plot-attention"),
        (["--beam", "3"], "drop --beam"),
        (["--alpha", "0.6"], "drop --alpha"),
        (["--greedy"], "drop --greedy"),
        (["--max-tokens", "100"], "drop --max-tokens"),
        (["--max-extra-len", "9"], "drop --max-extra-len"),
        (["--plot-dir", "x"], "drop --plot-dir"),
        (["--plot-heads"], "drop --plot-heads"),
    ],
)
def test_flags_the_curve_does_not_use_are_refused_not_ignored(flags, message, tmp_path, capsys):
    # They were ignored with exit 0: --output o.de was never written.
    argv = ["--workdir", tmp_path, "--plot-curve", tmp_path / "c.png", *flags]
    code = evaluate.main([str(a) for a in argv], load=_no_decoding)
    err = capsys.readouterr().err
    assert err.startswith("error: --plot-curve only draws the training curve: drop ")
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "c.png").exists()


@pytest.mark.parametrize("flags", [["--beam", "8"], ["--alpha", "0.6"]])
def test_greedy_with_beam_settings_is_refused_not_ignored(flags, capsys):
    with pytest.raises(SystemExit) as e:
        evaluate.parse_args(["--workdir", "w", "--split", "val", "--greedy", *flags])
    assert e.value.code == 2
    assert "--greedy searches without a beam: drop --beam and --alpha" in capsys.readouterr().err


@pytest.mark.parametrize("lang", ["en", "de"])
def test_output_onto_a_file_of_the_split_is_refused_before_decoding(
    lang, tmp_path, capsys, monkeypatch
):
    # It overwrote the references, and the next evaluation scored BLEU 100.
    for name, text in (("test2016.en", "a\n"), ("test2016.de", "b\n")):
        (tmp_path / name).write_text(text, encoding="utf-8")
    run = _run_config(tmp_path / "run", data={"dataset": "files", "data_dir": str(tmp_path)})
    monkeypatch.chdir(run)  # the file named otherwise than config.json's full path
    target = Path("..", f"test2016.{lang}")
    argv = ["--workdir", run, "--split", "test2016", "--output", target]
    code = evaluate.main([str(a) for a in argv], load=_no_decoding)
    err = capsys.readouterr().err
    side = "source" if lang == "en" else "reference"
    assert code == 2 and f"is split test2016's {side} file" in err and err.count("\n") == 1, err
    assert (tmp_path / "test2016.en").read_text() == "a\n"
    assert (tmp_path / "test2016.de").read_text() == "b\n"


def test_a_mistyped_or_missing_flag_is_one_line_not_the_whole_usage(capsys):
    for argv, fragment in (
        (["--workdir", "w", "--bem", "2"], "unrecognized arguments: --bem 2"),
        (["--split", "val"], "the following arguments are required: --workdir"),
    ):
        with pytest.raises(SystemExit) as exit_:
            evaluate.parse_args(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and fragment in err, err
        assert err.endswith("; evaluate.py --help lists the flags\n")


def test_an_empty_src_file_is_an_error_and_writes_nothing(workdir, tmp_path, capsys):
    empty = tmp_path / "empty.en"
    empty.write_bytes(b"")
    hyp = tmp_path / "hyp.de"
    code, out, err = _run(["--workdir", workdir, "--src-file", empty, "--output", hyp], capsys)
    assert code == 2 and err == f"error: {empty} is empty: nothing to translate\n"
    assert not hyp.exists()


def test_an_empty_compilation_cache_flag_is_a_usage_error(capsys):
    # Path("") is the current folder: the cache's files were written there.
    with pytest.raises(SystemExit) as exit_:
        evaluate.parse_args(["--workdir", "w", "--split", "val", "--compilation-cache", ""])
    assert exit_.value.code == 2
    assert "--compilation-cache is empty" in capsys.readouterr().err


def test_default_average_leaves_out_a_best_kept_from_long_before(tmp_path, monkeypatch):
    # keep_checkpoints 3: the last 3 are kept, and the best (step 100) besides them.
    checkpoints.save_run_config(tmp_path, {"model": {}, "train": {"keep_checkpoints": 3}})
    monkeypatch.setattr(checkpoints, "checkpoint_steps", lambda workdir: [100, 900, 950, 1000])
    assert translate.default_average_last(tmp_path) == 3  # before: 4, which averaged step 100 in
    checkpoints.save_run_config(tmp_path, {"model": {}, "train": {"keep_checkpoints": 10}})
    assert translate.default_average_last(tmp_path) == 4  # all it has: fewer than 5
    monkeypatch.setattr(checkpoints, "checkpoint_steps", lambda workdir: list(range(100, 800, 100)))
    assert translate.default_average_last(tmp_path) == 5  # of 7: the README's last 5


def test_the_librarys_default_parameters_are_the_ones_evaluate_scores(workdir, capsys):
    # load_run's default was the best checkpoint, so a library user scored other
    # parameters than the command line's default average.
    default, evaluated = (
        translate.load_run(workdir),
        evaluate._load_run(evaluate.parse_args(["--workdir", str(workdir), "--split", "val"])),
    )
    assert default.checkpoint == evaluated.checkpoint == "average of steps 200, 300, 400"
    for a, b in zip(
        jax.tree.leaves(default.params), jax.tree.leaves(evaluated.params), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_a_run_loaded_at_one_step_is_described_by_that_step_once(workdir):
    # checkpoint="300" was described as "step 300 (300)".
    for checkpoint in (300, "300"):
        assert translate.load_run(workdir, checkpoint=checkpoint).checkpoint == "step 300"
    assert translate.load_run(workdir, checkpoint="last").checkpoint == "step 400 (last)"


def test_the_best_checkpoint_is_named_as_the_best_until_it_is_damaged(workdir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(workdir, run)
    metrics = run / "checkpoints" / "300" / "metrics"
    metrics.mkdir()
    (metrics / "metrics").write_text('{"val_bleu": 12.5}')  # as a validation writes it
    assert translate.load_run(run, checkpoint="best").checkpoint == "step 300 (best)"
    damage_checkpoint(run / "checkpoints" / "300")
    assert translate.load_run(run, checkpoint="best").checkpoint == (
        "step 400 (the newest: the best, step 300, is damaged)"
    )
    # With another scored checkpoint, a damaged best gives way to the next best, not to
    # the newest (before, the newest was taken whatever its score).
    metrics = run / "checkpoints" / "200" / "metrics"
    metrics.mkdir()
    (metrics / "metrics").write_text('{"val_bleu": 11.0}')
    assert translate.load_run(run, checkpoint="best").checkpoint == (
        "step 200 (the best readable: the best, step 300, is damaged)"
    )


def test_evaluate_py_drops_orbaxs_log_records_as_train_py_does(monkeypatch, tmp_path, capsys):
    # A damaged checkpoint it skips is its one warning line, not asyncio's dozens besides
    # (tests/test_checkpoints.py checks the filter on those records).
    silenced = []
    monkeypatch.setattr(evaluate, "silence_orbax_logs", lambda: silenced.append(True))
    code, _, err = _run(["--workdir", tmp_path / "none", "--split", "val"], capsys)
    assert code == 2 and err.startswith("error: ") and silenced == [True]


def _leaf_means(steps, workdir):
    """The elementwise float64 mean of the parameters of `steps`, leaf by leaf."""
    trees = [checkpoints.restore_params(workdir, step)[0] for step in steps]
    return [
        np.mean(np.stack(leaves).astype(np.float64), axis=0)
        for leaves in zip(*(jax.tree.leaves(tree) for tree in trees), strict=True)
    ]


def test_the_scored_parameters_are_the_mean_of_the_averaged_checkpoints(workdir, capsys):
    # The header named the steps; the parameters themselves must be their mean, and
    # --average-last must reach evaluate.py's parameters too.
    default = translate.load_run(workdir)
    two = evaluate._load_run(
        evaluate.parse_args(["--workdir", str(workdir), "--split", "val", "--average-last", "2"])
    )
    assert two.checkpoint == "average of steps 300, 400"
    last, _ = checkpoints.restore_params(workdir, 400)
    one = translate.load_run(workdir, average_last=1)  # the last alone, not the default
    assert one.checkpoint == "average of steps 400"
    assert jax.tree.all(jax.tree.map(np.array_equal, one.params, last))
    for run, steps in ((default, (200, 300, 400)), (two, (300, 400))):
        leaves = jax.tree.leaves(run.params)
        for leaf, mean in zip(leaves, _leaf_means(steps, workdir), strict=True):
            assert leaf.dtype == np.float32
            np.testing.assert_allclose(leaf, mean, rtol=1e-6, atol=1e-7)
        # Trained parameters move between checkpoints: the mean is not the last one.
        assert any(
            not np.allclose(a, b) for a, b in zip(leaves, jax.tree.leaves(last), strict=True)
        )


def test_the_readmes_workdir_example_runs_on_a_trained_workdir(workdir, capsys):
    from test_readme import WORKDIR_EXAMPLE, readme_workdir_example

    example = readme_workdir_example().replace(WORKDIR_EXAMPLE, f"load_run({str(workdir)!r})")
    exec(compile(example, "README.md", "exec"), {})
    checkpoint, translations = capsys.readouterr().out.splitlines()
    assert checkpoint == "average of steps 200, 300, 400"
    assert translations.startswith("['") and translations.endswith("']")


def test_standard_input_gets_the_checks_of_a_file(workdir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", _piped_stdin("A dog.\nA cat.\n".encode("utf-16")))
    code, out, err = _run(["--workdir", workdir, "--translate", *FAST], capsys)
    assert code == 2 and out == "" and "standard input is UTF-16" in err


def test_a_run_with_no_checkpoint_yet_says_so(workdir, tmp_path, capsys):
    # A run killed before its first checkpoint: config.json and an empty checkpoints/.
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.json", "tokenizer.model"):
        shutil.copy(workdir / name, run / name)
    (run / "checkpoints").mkdir()
    assert evaluate.main(["--workdir", str(run), "--split", "val"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no checkpoints in {run / 'checkpoints'}; train with train.py")
    assert err.count("\n") == 1


def test_running_out_of_memory_names_a_line_too_long_for_max_tokens_to_help(
    workdir, tmp_path, capsys, monkeypatch
):
    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes.")

    monkeypatch.setattr(evaluate, "translate_ids", out_of_memory)
    src, hyp = tmp_path / "src.en", tmp_path / "hyp.de"
    src.write_text("A dog.\n" + "A man " * 60 + "\nTwo cats.\n", encoding="utf-8")
    argv = ["--workdir", workdir, "--src-file", src, *FAST, "--output", hyp]
    # Line 2's batch holds it alone under 128 tokens: lowering --max-tokens cannot help.
    code, _, err = _run([*argv, "--max-tokens", "128"], capsys)
    assert code == 1 and not hyp.exists()
    [line] = [e for e in err.splitlines() if e.startswith("error: ")]
    alone = re.search(
        r"; source line 2 \((\d+) tokens\) is decoded alone whatever --max-tokens is", line
    )
    assert alone and int(alone[1]) > 64, line
    # Under the default 4096 every line shares a batch: --max-tokens is the advice.
    code, _, err = _run(argv, capsys)
    [line] = [e for e in err.splitlines() if e.startswith("error: ")]
    assert code == 1 and line.endswith("; lower --max-tokens, --beam or --max-extra-len"), line


def test_running_out_of_memory_while_decoding_names_the_flags(tmp_path, capsys):
    def load(args):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes.")

    source = tmp_path / "in.en"
    source.write_text("A dog.\n", encoding="utf-8")
    argv = ["--workdir", str(tmp_path), "--translate", "--input", str(source)]
    code = evaluate.main(argv, load=load)
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("error: out of memory (RESOURCE_EXHAUSTED") and "--beam" in err


def test_the_memory_advice_names_the_longest_line_where_it_is_decoded_alone():
    # Two lines of one padded length share a batch while --max-tokens holds both, and
    # lowering --max-tokens still helps; one token less and each is decoded alone.
    lines = [[5] * 100, [5] * 100]
    padded = inference_length(100)
    for max_tokens, alone in ((2 * padded, False), (2 * padded - 1, True)):
        batches = list(translate.decoding_batches(lines, max_tokens=max_tokens, pad_id=0))
        assert len(batches) == (2 if alone else 1)
        advice = evaluate._memory_advice(argparse.Namespace(max_tokens=max_tokens), lines)
        assert ("source line 1 (100 tokens) is decoded alone" in advice) == alone, advice


def test_the_compilation_cache_flags_choose_where_compiled_programs_go(
    workdir, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRANSFORMER_MT_CACHE", str(tmp_path / "root"))
    curve = ["--workdir", workdir, "--plot-curve", tmp_path / "curve.png"]
    code, _, err = _run([*curve, "--no-compilation-cache"], capsys)
    assert code == 0 and not (tmp_path / "root").exists(), err  # no cache made
    code, _, err = _run([*curve, "--compilation-cache", tmp_path / "xla"], capsys)
    assert code == 0 and (tmp_path / "xla").is_dir() and not (tmp_path / "root").exists(), err
    code, _, err = _run(curve, capsys)
    assert code == 0 and (tmp_path / "root" / "xla").is_dir(), err  # the default
