"""Multi30k cache: download from a fake opener, checksum rejection, offline message, atomicity."""

import errno
import gzip
import http.client
import io
import os
import pathlib
import stat
import urllib.error

import pytest

import data
from data import multi30k


class FakeOpener:
    """Serves gzipped bytes per URL, like urllib's opener; records what was asked."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.urls: list[str] = []
        self.timeouts: list[float | None] = []

    def __call__(self, url, timeout=None):
        self.urls.append(url)
        self.timeouts.append(timeout)
        name = url.rsplit("/", 1)[1].removesuffix(".gz")
        return io.BytesIO(gzip.compress(self.files[name]))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRANSFORMER_MT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "multi30k"


def upstream(multi30k_dir, split, langs=("en", "de")):
    """The local files under their upstream names (test2016 is test_2016_flickr there)."""
    return {
        f"{multi30k.SPLITS[split]}.{lang}": (multi30k_dir / f"{split}.{lang}").read_bytes()
        for lang in langs
    }


def test_checksums_are_those_of_the_local_copies(multi30k_dir):
    import hashlib

    for name, sha in multi30k.SHA256.items():
        assert hashlib.sha256((multi30k_dir / name).read_bytes()).hexdigest() == sha
    assert len(multi30k.SHA256) == 3 * 4


def test_download_verifies_and_caches(multi30k_dir, cache, monkeypatch, capsys):
    opener = FakeOpener(upstream(multi30k_dir, "test2016"))
    monkeypatch.setattr(multi30k, "urlopen", opener)
    corpus = data.load_corpus(data.CorpusSpec(), "test2016")
    # A download of a minute or more says what it is doing, once per file.
    assert capsys.readouterr().err.splitlines() == [
        f"downloading Multi30k test2016.en into {cache}",
        f"downloading Multi30k test2016.de into {cache}",
    ]
    assert opener.urls == [
        "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/test_2016_flickr.en.gz",
        "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/test_2016_flickr.de.gz",
    ]
    for lang in ("en", "de"):
        assert (cache / f"test2016.{lang}").read_bytes() == (
            multi30k_dir / f"test2016.{lang}"
        ).read_bytes()
    assert sorted(p.name for p in cache.iterdir()) == [
        "test2016.de",
        "test2016.en",
    ]  # no temp files
    reference = data.load_corpus(data.CorpusSpec(data_dir=str(multi30k_dir)), "test2016")
    assert corpus.src == reference.src and corpus.tgt == reference.tgt
    assert corpus.tgt_path == str(cache / "test2016.de")
    data.load_corpus(data.CorpusSpec(), "test2016")
    assert len(opener.urls) == 2  # second use: from the cache
    assert capsys.readouterr().err == ""
    # A stalled connection ends in the offline advice, not a train.py that hangs for ever.
    assert opener.timeouts == [multi30k.TIMEOUT_S] * 2 and 0 < multi30k.TIMEOUT_S <= 300


def test_downloads_are_readable_as_the_umask_says(multi30k_dir, cache, monkeypatch):
    # A temporary file's 0600 made a cache shared through $TRANSFORMER_MT_CACHE unreadable
    # to every other user.
    monkeypatch.setattr(multi30k, "urlopen", FakeOpener(upstream(multi30k_dir, "val")))
    umask = os.umask(0o022)
    try:
        data.load_corpus(data.CorpusSpec(), "val")
    finally:
        os.umask(umask)
    for lang in ("en", "de"):
        assert stat.S_IMODE((cache / f"val.{lang}").stat().st_mode) == 0o644


def test_a_folder_in_the_place_of_a_download_is_named(multi30k_dir, cache, monkeypatch):
    monkeypatch.setattr(multi30k, "urlopen", FakeOpener(upstream(multi30k_dir, "val")))
    (cache / "val.en").mkdir(parents=True)
    with pytest.raises(data.DataError) as e:
        data.load_corpus(data.CorpusSpec(), "val")
    assert str(e.value) == (
        f"cannot put Multi30k val.en in place as {cache / 'val.en'} (Is a directory); "
        "remove what is there and run the same command again"
    )
    assert [p.name for p in cache.iterdir()] == ["val.en"]  # no temporary file is left


def test_a_download_interrupted_by_ctrl_c_leaves_no_file(multi30k_dir, cache, monkeypatch):
    in_cache_meanwhile = []

    class Interrupted(io.BytesIO):
        """A response during which the user presses Ctrl-C, after its first 2000 bytes."""

        def read(self, size=-1):
            if self.tell() >= 2000:
                in_cache_meanwhile.extend(p.name for p in cache.iterdir())
                raise KeyboardInterrupt
            return super().read(2000 - self.tell() if size < 0 else min(size, 2000 - self.tell()))

    def opener(url, timeout=None):
        return Interrupted(gzip.compress((multi30k_dir / "val.en").read_bytes()))

    monkeypatch.setattr(multi30k, "urlopen", opener)
    with pytest.raises(KeyboardInterrupt):
        data.load_corpus(data.CorpusSpec(), "val")
    # Until it is verified, a download is a hidden temporary file beside its final name, so
    # a process killed outright (no cleanup) leaves no val.en that a later run would trust.
    [partial] = in_cache_meanwhile
    assert partial.startswith(".val.en.") and partial.endswith(".part")
    assert list(cache.iterdir()) == []  # and Ctrl-C leaves not even that


def test_wrong_content_is_rejected_and_nothing_is_kept(multi30k_dir, cache, monkeypatch):
    files = upstream(multi30k_dir, "val")
    files["val.de"] = files["val.de"].replace(b"Mann", b"Frau", 1)
    monkeypatch.setattr(multi30k, "urlopen", FakeOpener(files))
    with pytest.raises(data.DataError) as e:
        data.load_corpus(data.CorpusSpec(), "val")
    message = str(e.value)
    assert "\n" not in message and "checksum mismatch" in message and "val.de" in message
    assert sorted(p.name for p in cache.iterdir()) == ["val.en"]  # the verified file only


def test_truncated_download_leaves_no_file(multi30k_dir, cache, monkeypatch):
    def opener(url, timeout=None):
        return io.BytesIO(gzip.compress((multi30k_dir / "val.en").read_bytes())[:5000])

    monkeypatch.setattr(multi30k, "urlopen", opener)
    with pytest.raises(data.DataError):
        data.load_corpus(data.CorpusSpec(), "val")
    assert list(cache.iterdir()) == []


def test_corrupt_gzip_stream_is_a_data_error_and_leaves_no_file(multi30k_dir, cache, monkeypatch):
    compressed = bytearray(gzip.compress((multi30k_dir / "val.en").read_bytes()))
    compressed[10] = 0xFF  # the first deflate block's header (after gzip's 10): invalid type

    def opener(url, timeout=None):
        return io.BytesIO(bytes(compressed))

    monkeypatch.setattr(multi30k, "urlopen", opener)
    with pytest.raises(data.DataError) as e:  # zlib.error, neither OSError nor EOFError
        data.load_corpus(data.CorpusSpec(), "val")
    message = str(e.value)
    assert "\n" not in message and "val.en" in message and "decompressing" in message
    assert list(cache.iterdir()) == []


def test_connection_closed_early_is_a_data_error_and_leaves_no_file(
    multi30k_dir, cache, monkeypatch
):
    class ClosedEarly(io.BytesIO):
        """A response whose server hangs up after its first 2000 bytes."""

        def read(self, size=-1):
            if self.tell() >= 2000:
                raise http.client.IncompleteRead(b"", 10000)
            return super().read(2000 - self.tell() if size < 0 else min(size, 2000 - self.tell()))

    def opener(url, timeout=None):
        return ClosedEarly(gzip.compress((multi30k_dir / "val.en").read_bytes()))

    monkeypatch.setattr(multi30k, "urlopen", opener)
    with pytest.raises(data.DataError) as e:
        data.load_corpus(data.CorpusSpec(), "val")
    message = str(e.value)
    assert "\n" not in message and "cannot download Multi30k val.en" in message
    assert "--data-dir" in message
    assert list(cache.iterdir()) == []


def test_cache_root_that_is_a_file_is_a_data_error(tmp_path, monkeypatch):
    root = tmp_path / "not_a_dir"
    root.write_text("a regular file\n")
    monkeypatch.setenv("TRANSFORMER_MT_CACHE", str(root))
    monkeypatch.setattr(multi30k, "urlopen", FakeOpener({}))
    with pytest.raises(data.DataError) as e:
        data.load_corpus(data.CorpusSpec(), "val")
    message = str(e.value)
    assert "\n" not in message and str(root / "multi30k") in message
    assert "$TRANSFORMER_MT_CACHE" in message and "permissions" in message
    assert root.read_text() == "a regular file\n"


@pytest.mark.parametrize(
    "owner, call",
    [(os, "open"), (pathlib.Path, "is_file")],
    ids=["unwritable", "cannot-be-looked-into"],
)
def test_a_cache_directory_without_permission_is_a_data_error(cache, monkeypatch, owner, call):
    real = getattr(owner, call)

    def denied(path, *args, **kwargs):  # what a read-only or unsearchable directory gives
        if str(path).startswith(str(cache)):  # (as root ignores chmod)
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(owner, call, denied)
    monkeypatch.setattr(multi30k, "urlopen", FakeOpener({}))
    with pytest.raises(data.DataError) as e:
        data.load_corpus(data.CorpusSpec(), "val")
    message = str(e.value)
    assert "\n" not in message and str(cache) in message and "Permission denied" in message
    assert "$TRANSFORMER_MT_CACHE" in message


@pytest.mark.parametrize("fails_at", ["write", "close"])
def test_a_full_disk_is_named_not_blamed_on_the_network(multi30k_dir, cache, monkeypatch, fails_at):
    fdopen = multi30k.os.fdopen

    class FullDisk(io.RawIOBase):  # what a full disk does to the file being written
        def __init__(self, fd):
            self.file = fdopen(fd, "wb")

        def writable(self):
            return True

        def write(self, b):
            if fails_at == "write":
                raise OSError(errno.ENOSPC, "No space left on device")
            return len(b)  # buffered; the disk fills when it is flushed

        def close(self):
            self.file.close()
            if fails_at == "close" and not self.closed:
                super().close()
                raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(multi30k.os, "fdopen", lambda fd, mode: FullDisk(fd))
    monkeypatch.setattr(multi30k, "urlopen", FakeOpener(upstream(multi30k_dir, "val")))
    with pytest.raises(data.DataError) as e:
        data.load_corpus(data.CorpusSpec(), "val")
    message = str(e.value)
    assert "\n" not in message and "download" not in message
    assert message.startswith(f"no space left on the disk of the Multi30k cache directory {cache};")
    assert list(cache.iterdir()) == []  # nothing half-written is kept


def test_offline_without_cache_says_how_to_use_data_dir(cache, monkeypatch):
    def offline(url, timeout=None):
        raise urllib.error.URLError(OSError(-2, "Name or service not known"))

    monkeypatch.setattr(multi30k, "urlopen", offline)
    with pytest.raises(data.DataError) as e:
        data.load_corpus(data.CorpusSpec(), "train")
    message = str(e.value)
    assert "\n" not in message and "Name or service not known" in message
    # Advice for both commands: evaluate.py has no --data-dir.
    assert f"in {cache}, or give train.py a folder of them with --data-dir" in message
    assert "evaluate.py scores such files with --src-file and --ref-file" in message
    assert list(cache.iterdir()) == []


def test_cached_files_read_for_evaluation_keep_every_line(cache, monkeypatch):
    # Evaluation scores translations line by line against the file: no pair is skipped.
    monkeypatch.setattr(multi30k, "urlopen", FakeOpener({}))  # no download here
    cache.mkdir(parents=True)
    (cache / "val.en").write_text("A dog.\n@@\n\nTwo men.\n")
    (cache / "val.de").write_text("Ein Hund.\n@@\nLeer.\nZwei M\u00e4nner.\n")
    corpus = data.load_corpus(data.CorpusSpec(), "val", clean=False)
    assert corpus.tgt == ["Ein Hund.", "@@", "Leer.", "Zwei M\u00e4nner."]
    assert corpus.references() == corpus.tgt and len(corpus.src) == 4


def test_unknown_split_and_language(cache):
    # A MissingSplitError, as load_corpus documents for every dataset.
    with pytest.raises(data.MissingSplitError, match="train, val, test2016"):
        data.load_corpus(data.CorpusSpec(), "test2017")
    with pytest.raises(data.DataError, match="en, de, fr, cs"):
        data.load_corpus(data.CorpusSpec(tgt="ja"), "train")
