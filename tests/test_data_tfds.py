"""The TFDS path, really exercised offline: a TFDS dataset built from a Multi30k slice."""

import functools
import io
import socket
import sys
import tempfile
import time

import pytest

import data
from data import tfds_source


@pytest.fixture(autouse=True)
def tfds_temporary_folders_in_tmp_path(tmp_path, monkeypatch):
    # A builder of data not yet prepared makes an empty mkdtemp("tfds") folder that TFDS
    # never removes (DatasetInfo.initialize_from_bucket): 10 a run were left in /tmp.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@functools.cache
def registered_translate_dataset() -> type:
    """A registered TFDS translation dataset (like wmt14_translate) made of the train.*
    and val.* files of its class attribute `folder`: TFDS names its val split validation."""
    import tensorflow_datasets as tfds

    class TinyMulti30kTranslate(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")
        folder = None

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                features=tfds.features.Translation(languages=["de", "en"]),
                disable_shuffling=True,
            )

        def _split_generators(self, dl_manager):
            return {
                "train": self._generate_examples("train"),
                "validation": self._generate_examples("val"),
            }

        def _generate_examples(self, split):
            en, de = (
                (self.folder / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()
                for lang in ("en", "de")
            )
            for i, (x, y) in enumerate(zip(en, de, strict=True)):
                yield i, {"en": x, "de": y}

    return TinyMulti30kTranslate


def tfds_spec(folder, tmp_path, **kw):
    return data.CorpusSpec(
        dataset="tfds", data_dir=str(folder), tfds_data_dir=str(tmp_path / "tfds"), **kw
    )


def test_tfds_folder_dataset_matches_the_files(multi30k_slice, tmp_path):
    folder = multi30k_slice(n=200, splits=("train", "val"))
    spec = tfds_spec(folder, tmp_path)
    for split in ("train", "val"):
        via_tfds = data.load_corpus(spec, split)
        via_files = data.load_corpus(spec.replace(dataset="files"), split)
        assert via_tfds.src == via_files.src and via_tfds.tgt == via_files.tgt  # same order
        assert str(via_tfds.summary) == str(via_files.summary)
    assert list((tmp_path / "tfds").glob("parallel_text_folder/*/1.0.0/*.array_record*"))
    reversed_pair = data.load_corpus(tfds_spec(folder, tmp_path, src="de", tgt="en"), "val")
    assert reversed_pair.src == via_files.tgt


def test_a_registered_tfds_dataset_is_read_without_tensorflow(
    multi30k_slice, tmp_path, monkeypatch
):
    # The path of wmt14_translate and the like, offline: --tfds-name, val found as TFDS's
    # validation, each language in its place, prepared as ArrayRecord files, which are read
    # without TensorFlow (TFDS's default, TFRecord, needs it to be written and read).
    folder = multi30k_slice(n=20, splits=("train", "val"))
    builder = registered_translate_dataset()
    monkeypatch.setattr(builder, "folder", folder)
    spec = data.CorpusSpec(
        dataset="tfds", tfds_name=builder.name, tfds_data_dir=str(tmp_path / "tfds")
    )
    for split in ("train", "val"):
        via_tfds = data.load_corpus(spec, split)
        via_files = data.load_corpus(
            spec.replace(dataset="files", tfds_name=None, data_dir=str(folder)), split
        )
        assert via_tfds.src == via_files.src and via_tfds.tgt == via_files.tgt
    assert list((tmp_path / "tfds").glob(f"{builder.name}/1.0.0/*-validation.array_record*"))
    reversed_pair = data.load_corpus(spec.replace(src="de", tgt="en"), "val")
    assert reversed_pair.src == via_files.tgt and reversed_pair.tgt == via_files.src


def test_tfds_errors_are_one_line(multi30k_slice, tmp_path):
    spec = tfds_spec(multi30k_slice(n=20, splits=("train", "val")), tmp_path)
    with pytest.raises(data.DataError, match="available splits: train, val"):
        data.load_corpus(spec, "test")
    with pytest.raises(data.DataError, match="no {split}.fr"):
        data.load_corpus(spec.replace(src="fr"), "train")
    registered = spec.replace(data_dir=None)  # its data is TFDS's own, not a folder
    with pytest.raises(data.DataError, match="unknown TFDS dataset 'no_such_translate'") as e:
        data.load_corpus(registered.replace(tfds_name="no_such_translate"), "train")
    # TFDS's own first line says what it could not find; the next ones list every dataset.
    assert "(Dataset no_such_translate not found.)" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(data.DataError, match="its languages are en, pt") as e:
        data.load_corpus(registered.replace(tfds_name="ted_hrlr_translate/pt_to_en"), "train")
    assert "choose them with --src/--tgt" in str(e.value)
    # No config named: TFDS takes the first (az_to_en); the error names the configs that
    # have both languages, not only other languages.
    with pytest.raises(data.DataError) as e:
        data.load_corpus(
            registered.replace(tfds_name="ted_hrlr_translate", src="pt", tgt="en"), "train"
        )
    message = str(e.value)
    assert "its default config, az_to_en" in message and "\n" not in message
    assert "--tfds-name ted_hrlr_translate/CONFIG (pt_to_en)" in message
    with pytest.raises(data.DataError, match="drop one of them"):  # a folder is not read
        data.load_corpus(spec.replace(tfds_name="ted_hrlr_translate/pt_to_en"), "train")
    with pytest.raises(data.DataError, match="--tfds-name"):
        data.load_corpus(data.CorpusSpec(dataset="tfds"), "train")


def test_a_split_one_file_short_is_an_error_as_for_the_files(multi30k_slice, tmp_path):
    # The builder's splits left it out: train.py trained without validation, with only a
    # warning that the folder had no split 'val', where --dataset files names the file.
    folder = multi30k_slice(n=20, splits=("train", "val"))
    (folder / "val.de").unlink()
    for spec in (tfds_spec(folder, tmp_path), tfds_spec(folder, tmp_path).replace(dataset="files")):
        with pytest.raises(data.DataError, match=r"^no val\.de in .*; add val\.de ") as e:
            data.load_corpus(spec, "val")
        assert not isinstance(e.value, data.MissingSplitError)  # not "no validation"


def test_files_of_different_lengths_are_the_files_error_not_a_download_error(
    multi30k_slice, tmp_path
):
    folder = multi30k_slice(n=20, splits=("val",))
    lines = (folder / "val.de").read_bytes().splitlines(keepends=True)
    (folder / "val.de").write_bytes(b"".join(lines[:-1]))
    spec = tfds_spec(folder, tmp_path)
    with pytest.raises(data.DataError) as via_files:
        data.load_corpus(spec.replace(dataset="files"), "val")
    with pytest.raises(data.DataError) as via_tfds:
        data.load_corpus(spec, "val")
    assert "val.en has 20 lines" in str(via_files.value) and "offline" not in str(via_tfds.value)
    assert str(via_tfds.value) == str(via_files.value)


def test_a_missing_wmt_split_is_reported_before_any_download(tmp_path):
    # WMT builders declare their splits before preparing; the check runs offline here, so
    # reaching the download would fail with "could not download/prepare" instead.
    spec = data.CorpusSpec(
        dataset="tfds", tfds_name="wmt14_translate/de-en", tfds_data_dir=str(tmp_path / "tfds")
    )
    with pytest.raises(data.MissingSplitError) as e:
        data.load_corpus(spec, "test2016")
    assert str(e.value) == (
        "wmt14_translate/de-en has no split 'test2016'; available splits: test, train, validation"
    )
    assert not list(tmp_path.rglob("*.array_record*"))


def test_bleu_references_from_tfds_are_the_raw_sentences_as_from_files(multi30k_slice, tmp_path):
    # Through TFDS (no file) BLEU was scored against the normalized references: "&amp;"
    # unescaped, a no-break space made a space, where the files path scores the raw lines.
    folder = multi30k_slice(n=20, splits=("val",))
    lines = (folder / "val.de").read_text(encoding="utf-8").splitlines()
    lines[3] = "Ein Hund &amp; eine\u00a0Katze."
    (folder / "val.de").write_text("\n".join(lines) + "\n", encoding="utf-8")
    spec = tfds_spec(folder, tmp_path)
    via_tfds = data.load_corpus(spec, "val", clean=False)
    via_files = data.load_corpus(spec.replace(dataset="files"), "val", clean=False)
    assert via_tfds.tgt_path is None and via_tfds.tgt[3] == "Ein Hund & eine Katze."
    assert via_tfds.references() == via_files.references() == lines


def test_edited_files_are_prepared_again(multi30k_slice, tmp_path):
    folder = multi30k_slice(n=20, splits=("val",))
    spec = tfds_spec(folder, tmp_path)
    assert len(data.load_corpus(spec, "val").src) == 20
    multi30k_slice(n=25, splits=("val",))
    assert len(data.load_corpus(spec, "val").src) == 25
    # A fixed translation: only the target file changes.
    lines = (folder / "val.de").read_text(encoding="utf-8").splitlines()
    lines[0] = "Eine korrigierte Übersetzung."
    (folder / "val.de").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert data.load_corpus(spec, "val", clean=False).tgt[0] == "Eine korrigierte Übersetzung."


def test_an_edit_past_the_first_megabyte_is_prepared_again(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "val.en").write_text("A long one.\nA dog.\n", encoding="utf-8")
    long_line = "ein sehr langer Satz " * 60_000  # 1.2 MB
    (folder / "val.de").write_text(f"{long_line}\nEin Hund.\n", encoding="utf-8")
    spec = tfds_spec(folder, tmp_path)
    assert data.load_corpus(spec, "val", clean=False).tgt[1] == "Ein Hund."
    (folder / "val.de").write_text(f"{long_line}\nEine Katze.\n", encoding="utf-8")
    assert data.load_corpus(spec, "val", clean=False).tgt[1] == "Eine Katze."


def test_renamed_files_are_prepared_again(multi30k_slice, tmp_path):
    # val.* renamed dev.* and back, the same lines: a copy prepared with the one split has
    # no split by the other name, and train.py would go on without validation.
    folder = multi30k_slice(n=20, splits=("val",))
    spec = tfds_spec(folder, tmp_path)
    expected = data.load_corpus(spec.replace(dataset="files"), "val")
    for lang in ("en", "de"):
        (folder / f"val.{lang}").rename(folder / f"dev.{lang}")
    assert data.load_corpus(spec, "dev").tgt == expected.tgt
    for lang in ("en", "de"):
        (folder / f"dev.{lang}").rename(folder / f"val.{lang}")
    assert data.load_corpus(spec, "val").tgt == expected.tgt


def test_an_unresolvable_download_host_fails_in_seconds(tmp_path, monkeypatch):
    # Offline, TFDS's downloader retries a host that does not resolve 10 times with
    # backoff (3.4 min) before its error; the one-line error must come in seconds.
    lookups = []

    def offline(host, *args, **kwargs):
        lookups.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", offline)
    monkeypatch.setattr(tfds_source, "UNRESOLVED_GIVE_UP_S", 2.0)  # 10 s by default
    spec = data.CorpusSpec(
        dataset="tfds", tfds_name="wmt14_translate/de-en", tfds_data_dir=str(tmp_path / "tfds")
    )
    start = time.monotonic()
    with pytest.raises(data.DataError) as e:
        data.load_corpus(spec, "train")
    assert 2.0 <= time.monotonic() - start < 30
    assert "the host www.statmt.org has not resolved for 2 s (offline?)" in str(e.value)
    assert "--dataset files" in str(e.value) and "\n" not in str(e.value)
    assert "www.statmt.org" in lookups and socket.getaddrinfo is offline  # put back


def test_a_dns_outage_shorter_than_the_limit_is_ridden_out(monkeypatch):
    # A host gives up only after failing for UNRESOLVED_GIVE_UP_S with no success between;
    # overlapping blocks (threads) leave the original resolver in place.
    down = {"flaky.test"}

    def resolver(host, *args, **kwargs):
        if host in down:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return ["an address"]

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    monkeypatch.setattr(tfds_source, "UNRESOLVED_GIVE_UP_S", 0.3)
    first, second = (tfds_source._no_retries_for_unresolved_hosts() for _ in range(2))
    first.__enter__()
    second.__enter__()
    with pytest.raises(socket.gaierror):  # an ordinary failure, which urllib3 retries
        socket.getaddrinfo("flaky.test", 80)
    time.sleep(0.2)
    down.clear()
    assert socket.getaddrinfo("flaky.test", 80) == ["an address"]  # the outage is over
    time.sleep(0.2)  # 0.4 s after the first failure, which the success has wiped out
    down.add("flaky.test")
    with pytest.raises(socket.gaierror):  # the clock started again at this failure
        socket.getaddrinfo("flaky.test", 80)
    time.sleep(0.35)
    with pytest.raises(tfds_source._UnresolvedHost):
        socket.getaddrinfo("flaky.test", 80)
    first.__exit__(None, None, None)  # the first block leaves before the second
    assert socket.getaddrinfo is not resolver
    second.__exit__(None, None, None)
    assert socket.getaddrinfo is resolver


def test_a_download_does_not_inherit_the_failures_of_an_earlier_one(monkeypatch):
    # The train and val splits are two downloads: a host that failed to resolve in the
    # first, and was not asked for again, gets its whole time in the second.
    def resolver(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    monkeypatch.setattr(tfds_source, "UNRESOLVED_GIVE_UP_S", 0.1)
    with tfds_source._no_retries_for_unresolved_hosts():
        with pytest.raises(socket.gaierror):
            socket.getaddrinfo("mirror.test", 80)
    time.sleep(0.15)
    with tfds_source._no_retries_for_unresolved_hosts():
        with pytest.raises(socket.gaierror):  # its first failure here, not _UnresolvedHost
            socket.getaddrinfo("mirror.test", 80)


def test_a_folder_with_empty_files_is_no_download_error(tmp_path):
    # Before: "TFDS could not download/prepare ...; if offline, ..." for local files.
    folder = tmp_path / "data"
    folder.mkdir()
    for split in ("train", "val"):
        for lang in ("en", "de"):
            (folder / f"{split}.{lang}").write_bytes(b"")
    spec = tfds_spec(folder, tmp_path)
    with pytest.raises(data.DataError) as e:
        data.load_corpus(spec, "train")
    message = str(e.value)
    assert message.startswith(f"TFDS found no sentence pairs for {folder} (as a TFDS dataset)")
    assert "offline" not in message and "\n" not in message


@pytest.mark.parametrize(
    "terminal, enabled, drawn",
    [(False, True, False), (True, True, True), (True, False, False)],
    ids=["log-file", "terminal", "terminal-no-progress"],
)
def test_tfds_draws_its_bars_at_a_terminal_only_and_not_under_no_progress(
    terminal, enabled, drawn, multi30k_slice, tmp_path, monkeypatch, caplog
):
    # `train.py --dataset tfds ... > train.log 2>&1` filled the log with TFDS's redrawn
    # bars and cursor moves, with --no-progress too, and three warnings of the folder
    # builder's "custom data configuration".
    folder = multi30k_slice(n=20, splits=("train",))
    stderr = io.StringIO()
    stderr.isatty = lambda: terminal
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(tfds_source, "_progress_bars", True)
    tfds_source.show_progress_bars(enabled)
    data.load_corpus(tfds_spec(folder, tmp_path), "train")
    assert ("Generating splits" in stderr.getvalue()) == drawn, stderr.getvalue()
    assert "custom data configuration" not in caplog.text + stderr.getvalue()
