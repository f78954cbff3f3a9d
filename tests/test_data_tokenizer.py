"""Tokenizer: special ids, exact round trip on test2016, deterministic training, reuse."""

import errno
import io
import pathlib
import shutil

import numpy as np
import pytest
import sentencepiece as spm

import data
from data.errors import os_error_line


@pytest.fixture
def small_corpus(multi30k_slice):
    spec = data.CorpusSpec(dataset="files", data_dir=str(multi30k_slice(n=300, splits=("train",))))
    return data.load_corpus(spec, "train")


def test_special_ids_come_from_the_model(multi30k_tokenizer):
    tok = multi30k_tokenizer
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    pieces = [tok.id_to_piece(i) for i in (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id)]
    assert pieces == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tok.vocab_size == data.DEFAULT_VOCAB_SIZE and tok.model_type == "bpe"
    ids = tok.encode("Ein Mann fährt Fahrrad.")
    assert ids and not {tok.pad_id, tok.bos_id, tok.eos_id} & set(ids)


@pytest.mark.parametrize("lang_side", ["src", "tgt"])  # en, de
def test_round_trip_on_test2016(multi30k_tokenizer, multi30k_dir, lang_side):
    test = data.load_corpus(data.CorpusSpec(data_dir=str(multi30k_dir)), "test2016", clean=False)
    sentences = getattr(test, lang_side)
    assert len(sentences) == 1000
    tok = multi30k_tokenizer
    for s in sentences:
        ids = tok.encode(s)
        assert tok.unk_id not in ids
        assert tok.decode(ids) == s  # s is already normalize()d


def test_unseen_characters_fall_back_to_bytes(multi30k_tokenizer):
    tok = multi30k_tokenizer
    s = data.normalize("Ein Schneemann ☃ in Zürich, 雪だるま.")
    ids = tok.encode(s)
    assert tok.unk_id not in ids and tok.decode(ids) == s
    assert any(tok.id_to_piece(i).startswith("<0x") for i in ids)


def test_decode_stops_at_eos_and_skips_pad_and_bos(multi30k_tokenizer):
    tok = multi30k_tokenizer
    ids = tok.encode("Zwei Hunde spielen.")
    row = [tok.bos_id, *ids, tok.eos_id, *tok.encode("Müll"), tok.pad_id, tok.pad_id]
    assert tok.decode(row) == "Zwei Hunde spielen."
    assert tok.decode([tok.pad_id, *ids[:2], tok.pad_id, *ids[2:]]) == "Zwei Hunde spielen."
    assert tok.decode(np.array([tok.bos_id, *ids], np.int32)) == "Zwei Hunde spielen."


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_training_is_deterministic(small_corpus, tmp_path, model_type):
    texts = small_corpus.src + small_corpus.tgt
    a = data.train_tokenizer(texts, tmp_path / "a.model", vocab_size=500, model_type=model_type)
    b = data.train_tokenizer(texts, tmp_path / "b.model", vocab_size=500, model_type=model_type)
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    assert a.fingerprint == b.fingerprint and a.model_type == model_type
    assert data.Tokenizer.load(tmp_path / "a.model").fingerprint == a.fingerprint


def test_training_uses_every_sentence_and_character_on_one_thread(small_corpus, tmp_path):
    # Each setting changes the model without an error: rare characters to bytes (coverage),
    # another model on a machine of other core count (threads), text rewritten by NFKC.
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    data.train_tokenizer(small_corpus.src + small_corpus.tgt, tmp_path / "t.model", vocab_size=400)
    proto = model_pb2.ModelProto.FromString((tmp_path / "t.model").read_bytes())
    spec = proto.trainer_spec
    assert (spec.character_coverage, spec.byte_fallback, spec.num_threads) == (1.0, True, 1)
    assert (spec.input_sentence_size, spec.shuffle_input_sentence) == (0, False)
    assert proto.normalizer_spec.name == "identity"
    # Sentences up to 64 KiB are trained on (SentencePiece's default skips those over 4192
    # bytes, without a word).
    assert spec.max_sentence_length == data.tokenizer.MAX_SENTENCE_BYTES == 1 << 16


def test_training_reads_the_first_and_the_last_sentence(small_corpus, tmp_path):
    # Every character seen in training is a piece of its own (character coverage 1.0);
    # one seen nowhere falls back to bytes. These three are only in the first and last line.
    texts = ["\u1e9e \u01c4", *small_corpus.src, *small_corpus.tgt, "\u01a9"]
    tok = data.train_tokenizer(texts, tmp_path / "t.model", vocab_size=400)
    for character in "\u1e9e\u01c4\u01a9":
        assert [tok.id_to_piece(i) for i in tok.encode(character)] == ["\u2581", character]


def test_training_prints_nothing(small_corpus, tmp_path, capfd):
    # SentencePiece logs every setting and step to the process's stderr unless told not
    # to: pages of it before train.py's first line.
    data.train_tokenizer(small_corpus.src + small_corpus.tgt, tmp_path / "t.model", vocab_size=400)
    assert capfd.readouterr() == ("", "")


def test_the_fingerprint_tells_apart_models_that_differ_only_near_their_end(small_corpus, tmp_path):
    # The token cache is keyed by it: 400 and 401 pieces share their first 5 KB (the pieces
    # in order), and a fingerprint of a prefix gave one key for both.
    texts = small_corpus.src + small_corpus.tgt
    a = data.train_tokenizer(texts, tmp_path / "a.model", vocab_size=400)
    b = data.train_tokenizer(texts, tmp_path / "b.model", vocab_size=401)
    assert a.fingerprint != b.fingerprint


def test_a_model_whose_pad_id_is_not_0_is_refused(small_corpus, tmp_path):
    # The model builds its attention and loss masks from id 0: a model made elsewhere with
    # another pad id would train on padding.
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(small_corpus.src),
        model_writer=model,
        vocab_size=300,
        pad_id=1,
        unk_id=0,
        bos_id=2,
        eos_id=3,
        minloglevel=2,
    )
    path = tmp_path / "other.model"
    path.write_bytes(model.getvalue())
    with pytest.raises(data.DataError) as e:
        data.Tokenizer.load(path)
    assert str(e.value) == (
        f"tokenizer {path} has pad id 1, expected 0; retrain it with train_tokenizer"
    )


def test_load_or_train_reuses_the_run_model(small_corpus, tmp_path):
    first = data.load_or_train_tokenizer(tmp_path, small_corpus, vocab_size=400, model_type="bpe")
    assert first.path == str(tmp_path / "tokenizer.model")
    # One vocabulary for both languages (the paper's shared source-target vocabulary).
    joint = small_corpus.src + small_corpus.tgt
    assert data.train_tokenizer(joint, tmp_path / "joint.model", vocab_size=400).fingerprint == (
        first.fingerprint
    )
    other = data.Corpus(src=["x y z"] * 5, tgt=["a b c"] * 5, summary=small_corpus.summary)
    again = data.load_or_train_tokenizer(tmp_path, other, vocab_size=400, model_type="bpe")
    assert again.fingerprint == first.fingerprint  # loaded, not retrained on `other`
    with pytest.raises(data.DataError) as e:  # the file by its path, each size where it goes
        data.load_or_train_tokenizer(tmp_path, small_corpus, vocab_size=800, model_type="bpe")
    assert str(e.value) == (
        f"{tmp_path / 'tokenizer.model'} is a bpe model of 400 pieces but bpe with 800 was "
        "asked; use a new --workdir or the settings of this one"
    )
    # Another model type of the same size: the bpe model must not pass for a unigram one.
    with pytest.raises(data.DataError, match="is a bpe model of 400 pieces but unigram with 400"):
        data.load_or_train_tokenizer(tmp_path, small_corpus, vocab_size=400, model_type="unigram")


def test_the_run_tokenizer_defaults_are_the_default_tokenizer(multi30k_tokenizer, tmp_path):
    # A run's tokenizer.model of the library's defaults (joint BPE of DEFAULT_VOCAB_SIZE) is
    # reused by load_or_train_tokenizer called with its own defaults, not refused.
    shutil.copy(multi30k_tokenizer.path, tmp_path / "tokenizer.model")
    tokenizer = data.load_or_train_tokenizer(tmp_path, corpus=None)
    assert tokenizer.fingerprint == multi30k_tokenizer.fingerprint


def test_bad_settings_and_files_are_one_line_errors(small_corpus, tmp_path):
    texts = small_corpus.src[:50]
    with pytest.raises(data.DataError, match=r"choose a smaller vocab_size \(--vocab-size\)") as e:
        data.train_tokenizer(texts, tmp_path / "t.model", vocab_size=8000)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("vocabulary size 8000 is too large for this corpus;")
    for empty in ([], ["", ""]):  # not SentencePiece's error, nor "every sentence too long"
        with pytest.raises(data.DataError) as e:
            data.train_tokenizer(empty, tmp_path / "t.model", vocab_size=300)
        assert str(e.value) == "cannot train a tokenizer on an empty corpus"
    with pytest.raises(data.DataError, match=r"choose a larger vocab_size \(--vocab-size\)"):
        data.train_tokenizer(texts, tmp_path / "t.model", vocab_size=100)
    with pytest.raises(data.DataError, match="model type"):
        data.train_tokenizer(texts, tmp_path / "t.model", model_type="wordpiece")
    # SentencePiece skips sentences over 64 KiB: with only such, its error was an INTERNAL
    # check of its source code.
    # The limit is in bytes: "Grüße " * 9000 is 54000 characters and 72000 bytes.
    for long in ("a dog " * 11000, "Gr\u00fc\u00dfe " * 9000):
        with pytest.raises(data.DataError) as e:
            data.train_tokenizer([long] * 3, tmp_path / "t.model", vocab_size=300)
        assert str(e.value) == (
            "cannot train a tokenizer: every sentence of the training data is longer than 65536 "
            "bytes, which SentencePiece skips; split the lines into sentences"
        )
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(data.DataError, match="not a SentencePiece model"):
        data.Tokenizer.load(tmp_path / "junk.model")
    # One damaged byte in a piece's name (b"<0x1A>" -> b"<0\xda1A>") was a UnicodeDecodeError.
    data.train_tokenizer(texts, tmp_path / "t.model", vocab_size=400)
    raw = (tmp_path / "t.model").read_bytes()
    (tmp_path / "damaged.model").write_bytes(raw.replace(b"<0x1A>", b"<0\xda1A>", 1))
    with pytest.raises(data.DataError, match="damaged.model is not a SentencePiece model") as e:
        data.Tokenizer.load(tmp_path / "damaged.model")
    assert "\n" not in str(e.value)
    with pytest.raises(data.DataError) as e:  # named by its path, not its name alone
        data.Tokenizer.load(tmp_path / "missing.model")
    assert (
        str(e.value)
        == f"cannot read tokenizer {tmp_path / 'missing.model'}: No such file or directory"
    )
    (tmp_path / "empty.model").write_bytes(b"")  # was reported as "pad id -1, expected 0"
    with pytest.raises(data.DataError) as e:  # said once, by the path it was loaded from
        data.Tokenizer.load(tmp_path / "empty.model")
    assert str(e.value) == (
        f"tokenizer {tmp_path / 'empty.model'} is empty, not a SentencePiece model; "
        "delete it to train it again (train.py does, from the run's data)"
    )


def test_a_failure_with_some_sentences_too_long_is_not_blamed_on_them(
    small_corpus, tmp_path, monkeypatch
):
    # SentencePiece skips sentences over 64 KiB; only where it skipped them all is that
    # the reason it failed. With one among many, its own message is the one to show.
    def fails(**kwargs):
        raise RuntimeError("Internal: trainer_interface.cc(1) [false] some check\n")

    monkeypatch.setattr(data.tokenizer.spm.SentencePieceTrainer, "train", fails)
    texts = [*small_corpus.src[:50], "a dog " * 11000]
    with pytest.raises(data.DataError) as e:
        data.train_tokenizer(texts, tmp_path / "t.model", vocab_size=400)
    assert str(e.value) == (
        "tokenizer training failed: Internal: trainer_interface.cc(1) [false] some check"
    )
    assert not (tmp_path / "t.model").exists()


def test_a_full_disk_leaves_no_half_written_tokenizer(small_corpus, tmp_path, monkeypatch):
    def full(self, content):  # part of the file, then the disk is full
        with open(self, "wb") as f:
            f.write(content[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_bytes", full)
    path = tmp_path / "run" / "tokenizer.model"
    texts = small_corpus.src + small_corpus.tgt
    with pytest.raises(OSError) as info:
        data.train_tokenizer(texts, path, vocab_size=400, model_type="bpe")
    assert list(path.parent.iterdir()) == []  # the temporary file was removed too
    assert os_error_line(info.value, again="training resumes") == (
        f"{path}: No space left on device; make room there and run the same command again "
        "(training resumes)"
    )
