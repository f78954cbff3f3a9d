"""BPE-dropout's training data: the same sentences, segmented anew in every copy."""

import dataclasses
import re

import pytest

import data
from benchmarks import bpe_dropout
from benchmarks.bpe_dropout import encode_sampled_copies


def test_every_copy_is_the_corpus_segmented_anew(multi30k_dir, multi30k_tokenizer, tmp_path):
    train = data.load_corpus(data.CorpusSpec(data_dir=str(multi30k_dir)), "train")
    corpus = dataclasses.replace(train, src=train.src[:200], tgt=train.tgt[:200])
    plain = data.encode_corpus(multi30k_tokenizer, corpus, max_len=None)
    kw = dict(max_len=None, cache_dir=tmp_path)  # every pair kept, however long its sample
    sampled = encode_sampled_copies(multi30k_tokenizer, corpus, 3, 0.1, **kw)
    assert len(sampled) == 3 * len(plain) == 600
    for side, text in ((sampled.src, corpus.src), (sampled.tgt, corpus.tgt)):
        assert [multi30k_tokenizer.decode(ids) for ids in side] == text * 3
    copies = [[ids.tolist() for ids in sampled.tgt[i * 200 : (i + 1) * 200]] for i in range(3)]
    assert copies[0] != copies[1] != copies[2] != copies[0]
    assert min(sum(map(len, c)) for c in copies) > sum(map(len, plain.tgt))
    # Cached under its own key: a resume reads these copies, and plain ids are not mistaken.
    again = encode_sampled_copies(multi30k_tokenizer, corpus, 3, 0.1, **kw)
    assert all((a == b).all() for a, b in zip(again.tgt, sampled.tgt, strict=True))
    one = encode_sampled_copies(multi30k_tokenizer, corpus, 1, 0.1, **kw)
    cached_plain = data.encode_corpus(multi30k_tokenizer, corpus, **kw)
    assert sum(map(len, one.tgt)) > sum(map(len, cached_plain.tgt)) == sum(map(len, plain.tgt))


def test_trains_on_the_copies_and_puts_encode_corpus_back(multi30k_slice, tmp_path, capsys):
    flags = [
        "--copies", "2", "--alpha", "0.1",
        "--workdir", str(tmp_path / "run"), "--dataset", "files",
        "--data-dir", str(multi30k_slice(n=300)), "--preset", "tiny", "--vocab-size", "400",
        "--max-tokens", "1024", "--max-shapes", "1", "--steps", "2", "--warmup-steps", "1",
        "--eval-every", "0", "--bleu-every", "0", "--no-progress", "--max-len", "24",
    ]  # fmt: skip
    assert bpe_dropout.main(flags) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("bpe-dropout: 2 copies"))
    pairs = int(line.split(": ")[2].split()[0])
    # Both copies of every kept pair, less those that sampling made too long for --max-len.
    kept = int(re.search(r"data: train en-de: \d+ pairs read, (\d+) kept", out)[1])
    dropped = int(re.search(rf"data: {pairs} pairs encoded, (\d+) longer than", out)[1])
    assert pairs + dropped == 2 * kept
    # Sampling makes sentences longer. Counted over the copies --max-len had filtered (it
    # drops more sampled pairs than plain ones), the ratios came out below 1.
    ratios = re.search(r"deterministic one: source ([\d.]+), target ([\d.]+)", line)
    assert float(ratios[1]) > 1 and float(ratios[2]) > 1, line
    assert data.encode_corpus is bpe_dropout.encode_corpus


def test_a_unigram_tokenizer_is_an_error_not_another_method(multi30k_slice, tmp_path, capsys):
    # Before: unigram sampling ran and was reported as BPE-dropout.
    flags = [
        "--copies", "2", "--workdir", str(tmp_path / "run"), "--dataset", "files",
        "--data-dir", str(multi30k_slice(n=100)), "--preset", "tiny", "--vocab-size", "400",
        "--tokenizer-type", "unigram", "--steps", "1", "--no-progress",
    ]  # fmt: skip
    assert bpe_dropout.main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: BPE-dropout needs the BPE tokenizer; this run's is unigram")
    assert not (tmp_path / "run").exists() and data.encode_corpus is bpe_dropout.encode_corpus


def _corpus(multi30k_dir, n=200, tgt=None):
    train = data.load_corpus(data.CorpusSpec(data_dir=str(multi30k_dir)), "train")
    return dataclasses.replace(train, src=train.src[:n], tgt=tgt or train.tgt[:n])


def _tokens(side):
    return sum(map(len, side))


def test_copies_of_another_alpha_are_sampled_anew_not_read_from_the_cache(
    multi30k_dir, multi30k_tokenizer, tmp_path
):
    corpus, kw = _corpus(multi30k_dir), dict(max_len=None, cache_dir=tmp_path)
    low = encode_sampled_copies(multi30k_tokenizer, corpus, 2, 0.1, **kw)
    high = encode_sampled_copies(multi30k_tokenizer, corpus, 2, 0.5, **kw)
    assert _tokens(high.src) > 1.2 * _tokens(low.src)


def test_the_flags_reach_the_sampling_the_cache_and_the_printed_ratios(
    multi30k_dir, multi30k_tokenizer, tmp_path, monkeypatch, capsys
):
    # A target side of "." only: two pieces no merge joins, so sampling leaves it as it is.
    corpus = _corpus(multi30k_dir, tgt=["."] * 200)
    tok, seen = multi30k_tokenizer, {"train": []}
    assert len(tok.encode_batch(["."])[0]) == 2

    def fake_train(argv):  # what train.py asks of data.encode_corpus
        seen["argv"] = argv
        seen["train"].append(data.encode_corpus(tok, corpus, max_len=999, cache_dir=tmp_path))
        seen["val"] = data.encode_corpus(tok, corpus, max_len=None, cache_dir=tmp_path)
        return 0

    monkeypatch.setattr(bpe_dropout.train, "main", fake_train)
    assert bpe_dropout.main(["--copies", "3", "--alpha", "0.3", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert bpe_dropout.main(["--copies", "3", "--alpha", "0.3", "--steps", "2"]) == 0  # resume
    assert seen["argv"] == ["--steps", "2"]
    sampled, again = seen["train"]
    assert len(sampled) == 600
    assert all((a == b).all() for a, b in zip(again.src, sampled.src, strict=True))  # cached
    # Validation is one deterministic copy.
    plain = data.encode_corpus(tok, corpus, max_len=None)
    assert [ids.tolist() for ids in seen["val"].src] == [ids.tolist() for ids in plain.src]
    # Sampled at --alpha 0.3 (longer than at 0.1), and the printed source ratio is the copies'.
    copies_ratio = _tokens(sampled.src) / (3 * _tokens(plain.src))
    assert copies_ratio > bpe_dropout.length_ratios(tok, corpus, 0.1)[0] + 0.2
    (line,) = [x for x in out.splitlines() if x.startswith("bpe-dropout:")]
    ratios = re.search(r"deterministic one: source ([\d.]+), target ([\d.]+)$", line)
    assert line.startswith("bpe-dropout: 3 copies, alpha 0.3: 600 pairs;")
    assert abs(float(ratios[1]) - copies_ratio) < 0.15 and ratios[2] == "1.000", line

    # The defaults: 16 copies at alpha 0.1.
    capsys.readouterr()
    assert bpe_dropout.main([]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("bpe-dropout:")]
    assert line.startswith("bpe-dropout: 16 copies, alpha 0.1: 3200 pairs;"), line


@pytest.mark.parametrize("flags", [["--copies", "0"], ["--alpha", "0"], ["--alpha", "1"]])
def test_copies_below_one_and_an_alpha_outside_0_1_are_usage_errors(flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        bpe_dropout.main(flags)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.endswith("error: --copies must be at least 1 and --alpha between 0 and 1")
