"""The literature's Multi30k BLEU: case-blind, hyphens split, multi-bleu.perl's numbers."""

import math

import pytest

from benchmarks.tokenized_bleu import main, moses_prepare, tokenized_bleu


def test_prepares_text_as_the_multi30k_papers_do():
    assert moses_prepare(["Ein Mann im T-Shirt spielt Gitarre."], "de") == [
        "ein mann im t @-@ shirt spielt gitarre ."
    ]


def test_case_and_detokenized_spacing_do_not_count():
    hyp, ref = "EIN Mann im T-Shirt spielt Gitarre.", "ein Mann im T-Shirt spielt Gitarre ."
    assert tokenized_bleu([hyp], [ref], "de").score == pytest.approx(100.0)


def test_hyphen_split_pieces_are_scored_as_multi_bleu_perl_would():
    # "a man @-@ made lake ." against "... pond .": 5/6, 3/5, 2/4 and 1/3 n-gram matches.
    expected = 100 * math.exp(sum(map(math.log, (5 / 6, 3 / 5, 2 / 4, 1 / 3))) / 4)
    score = tokenized_bleu(["A man-made lake."], ["A man-made pond."], "en")
    assert score.score == pytest.approx(expected, rel=1e-12)
    # No smoothing: an n-gram order without a match gives 0, as in multi-bleu.perl.
    assert tokenized_bleu(["A lake."], ["A pond."], "en").score == 0.0


def test_cli_scores_files_and_rejects_misaligned_ones(tmp_path, capsys):
    hyp, ref, short = tmp_path / "hyp", tmp_path / "ref", tmp_path / "short"
    hyp.write_text("Two dogs run.\nA man-made lake.\n")
    ref.write_text("Two dogs run.\nA man-made pond.\n")
    short.write_text("Two dogs run.\n")
    assert main([str(hyp), str(ref), "--lang", "en"]) == 0
    # Moses -a splits "man-made" into man @-@ made: 10 tokens a side, the last one wrong,
    # so 9/10, 6/8, 4/6 and 2/4 n-grams match: 100 * (9/10 * 6/8 * 4/6 * 2/4) ** (1/4).
    assert capsys.readouterr().out.startswith("BLEU = 68.87 90.0/75.0/66.7/50.0 (BP = 1.000")
    assert main([str(short), str(ref), "--lang", "en"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1 lines" in err and "2" in err


def test_cli_rejects_empty_files_in_one_line(tmp_path, capsys):
    # sacreBLEU raises IndexError on an empty corpus.
    hyp, ref = tmp_path / "hyp", tmp_path / "ref"
    hyp.write_bytes(b"")
    ref.write_bytes(b"")
    assert main([str(hyp), str(ref), "--lang", "de"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {hyp} and {ref} are empty: nothing to score\n"
