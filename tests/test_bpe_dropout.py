"""BPE-dropout's training data: the same sentences, segmented anew in every copy."""

import dataclasses
import re

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
