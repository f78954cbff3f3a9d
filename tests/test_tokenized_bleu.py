"""The literature's Multi30k BLEU: case-blind, hyphens split, multi-bleu.perl's numbers."""

import math
import sys

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


def test_german_is_prepared_by_the_german_moses_rules():
    # Typographic quotes, dashes and ellipses become ASCII, so that a hypothesis is not
    # penalized for the reference's quote style; German puts the comma after the closing
    # quote and splits an apostrophe off on both sides (English: "peter 's").
    assert moses_prepare(["„Hallo,“ sagt Peter's Hund – müde…"], "de") == [
        '" hallo " , sagt peter \' s hund - müde ...'
    ]
    assert moses_prepare(['"Hi," says Peter\'s dog.'], "en") == ['" hi , " says peter \'s dog .']
    hyp, ref = 'Er sagt "Hallo" ...', "Er sagt „Hallo“ …"
    assert tokenized_bleu([hyp], [ref], "de").score == pytest.approx(100.0)


def test_no_smoothing_when_only_the_longest_n_grams_miss():
    # 4/5, 2/4, 1/3 and 0/2 matches: multi-bleu.perl gives 0 (smoothing would not).
    score = tokenized_bleu(["Two dogs run fast."], ["Two dogs run slowly."], "en")
    assert score.score == 0.0 and [round(p, 1) for p in score.precisions] == [80, 50, 33.3, 0]


def test_a_short_hypothesis_is_penalized_not_the_reference(tmp_path, capsys):
    hyp, ref = tmp_path / "hyp", tmp_path / "ref"
    hyp.write_text("Two dogs run in the park\n")
    ref.write_text("Two dogs run in the big park .\n")
    assert main([str(hyp), str(ref), "--lang", "en"]) == 0
    # 6 hypothesis tokens against 8: BP = exp(1 - 8/6) (the reference's length would give
    # 1); every n-gram of the hypothesis but those ending in "the park" matches.
    bp = math.exp(1 - 8 / 6)
    expected = bp * 100 * math.exp(sum(map(math.log, (6 / 6, 4 / 5, 3 / 4, 2 / 3))) / 4)
    line = capsys.readouterr().out
    assert line.startswith(f"BLEU = {expected:.2f} 100.0/80.0/75.0/66.7 (BP = {bp:.3f} ")
    assert "hyp_len = 6 ref_len = 8" in line
    assert line.endswith(" (lowercased, Moses-tokenized -a, en)\n")


def test_a_test_set_of_sentences_ending_in_a_period_draws_no_warning(caplog):
    # Moses-tokenized text ends in " ." on purpose: sacreBLEU's "forgot to detokenize?"
    # warning (after 100 such lines) would be wrong here.
    lines = [f"Dog number {i} runs." for i in range(120)]
    with caplog.at_level("WARNING"):
        assert tokenized_bleu(lines, lines, "en").score == pytest.approx(100.0)
    assert caplog.records == []


def test_cli_needs_the_language(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "hyp"), str(tmp_path / "ref")])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith("error: the following arguments are required: --lang")
    )


def test_cli_without_sacremoses_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    hyp = tmp_path / "hyp"
    hyp.write_text("Two dogs run.\n")
    monkeypatch.setitem(sys.modules, "sacremoses", None)  # its import fails
    assert main([str(hyp), str(hyp), "--lang", "en"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "error: this needs sacremoses: pip install sacremoses\n"


def test_cli_prepares_both_files_by_the_rules_of_lang(tmp_path, capsys):
    # German Moses rules split "peter's" into three tokens (English: peter 's), so the
    # hypothesis has 9 tokens and 8/9, 6/8, 4/7 and 2/6 of its n-grams match.
    hyp, ref = tmp_path / "hyp", tmp_path / "ref"
    hyp.write_text("Peter's Hund schläft auf dem Sofa.\n")
    ref.write_text("Peter's Katze schläft auf dem Sofa.\n")
    assert main([str(hyp), str(ref), "--lang", "de"]) == 0
    out = capsys.readouterr().out
    assert " 88.9/75.0/57.1/33.3 " in out and "hyp_len = 9 ref_len = 9" in out
    assert out.endswith("-a, de)\n")
