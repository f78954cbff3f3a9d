"""The default dataset, Multi30k (task 1), fetched once into a local cache.

Files come from the Multi30k project's repository
(github.com/multi30k/dataset, ``data/task1/raw/{train,val,test_2016_flickr}.{lang}.gz``),
are gunzipped, checked against the SHA-256 below, and stored as
``{cache}/multi30k/{train,val,test2016}.{lang}``. The cache root is
``$TRANSFORMER_MT_CACHE`` when set, else ``~/.cache/transformer-mt``.

A download is written to a temporary file in the cache directory and renamed
into place only once its checksum matches, so an interrupted or corrupted
download never leaves a half-written file that a later run would trust.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import http.client
import os
import sys
import urllib.error
import urllib.request
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

from data.errors import DataError, MissingSplitError

BASE_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"
LANGUAGES = ("en", "de", "fr", "cs")
SPLITS = {"train": "train", "val": "val", "test2016": "test_2016_flickr"}  # ours -> upstream name

# SHA-256 of the gunzipped upstream files.
SHA256 = {
    "train.en": "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6",
    "train.de": "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72",
    "train.fr": "5925a3c18f1587b6b54b87743106e6e8ab93618edb6f65d19eac0621f853a10d",
    "train.cs": "2be68b38c8d586ff4f54eb13cc6e1baaaa053695b3f070d3038303a47f2268da",
    "val.en": "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227",
    "val.de": "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660",
    "val.fr": "5304e444d842e962b2dda4d816b70b22a1765b15401642b7ca37a67477e708dc",
    "val.cs": "d53827e469b0a1ca8d57e9e26b2b64c4bc4b33f5479c7b03ae87ae5c882c3e33",
    "test2016.en": "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182",
    "test2016.de": "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16",
    "test2016.fr": "cb3160d69b002bb638e66cc7612fcd56cb0af82eadc9c142dedc438afb885ef6",
    "test2016.cs": "45adb85f688de8407fddcbe1b36dca15d12aab868149b337e2576f2d6d2ff8d8",
}

# Tests replace this with a fake opener; it takes a URL and returns a binary file object.
urlopen = urllib.request.urlopen
TIMEOUT_S = 60


def cache_dir() -> Path:
    """Cache dir: ``$TRANSFORMER_MT_CACHE/multi30k`` or ``~/.cache/transformer-mt/multi30k``."""
    root = os.environ.get("TRANSFORMER_MT_CACHE") or os.path.join("~", ".cache", "transformer-mt")
    return Path(root).expanduser() / "multi30k"


def url(split: str, lang: str) -> str:
    """The upstream URL of the gzipped ``{split}.{lang}`` file."""
    return f"{BASE_URL}/{SPLITS[split]}.{lang}.gz"


def _offline_hint(directory: Path) -> str:
    return (
        "if you are offline, place the Multi30k files, named {train,val,test2016}.{lang} "
        f"(plain text, one sentence per line), in {directory}, or give train.py a folder of "
        "them with --data-dir (evaluate.py scores such files with --src-file and --ref-file)"
    )


def _cache_error(directory: Path, e: OSError) -> DataError:
    if e.errno == errno.ENOSPC:
        return DataError(
            f"no space left on the disk of the Multi30k cache directory {directory}; make "
            "room there, or set $TRANSFORMER_MT_CACHE to a folder on a disk with room, and "
            "run the same command again"
        )
    return DataError(
        f"cannot use the Multi30k cache directory {directory} ({e.strerror or e}); "
        "set $TRANSFORMER_MT_CACHE to a writable directory or fix its permissions"
    )


def _downloaded_chunks(source: str, name: str, directory: Path) -> Iterator[bytes]:
    """The gunzipped bytes at `source`, a megabyte at a time; whatever the network or the
    stream does wrong is a DataError that says how to go on offline."""
    try:
        with urlopen(source, timeout=TIMEOUT_S) as response, gzip.GzipFile(fileobj=response) as gz:
            while chunk := gz.read(1 << 20):
                yield chunk
    # gzip: a bad header or CRC is an OSError, a truncated stream an EOFError, corrupt
    # compressed data a zlib.error; a connection the server closes early is an
    # http.client.IncompleteRead (an HTTPException, not an OSError)
    except (urllib.error.URLError, OSError, EOFError, zlib.error, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise DataError(
            f"cannot download Multi30k {name} from {source} ({reason}); " + _offline_hint(directory)
        ) from None


def download(split: str, lang: str, directory: Path) -> Path:
    """Downloads, gunzips and verifies one file into ``directory``, atomically.

    Args:
      split: ``"train"``, ``"val"`` or ``"test2016"``.
      lang: one of :data:`LANGUAGES`.
      directory: destination; created if needed.

    Returns:
      The path of the verified file ``directory/{split}.{lang}``.

    Raises:
      DataError: no network, an HTTP error, a corrupt download, a checksum
        mismatch, or a cache directory that cannot be created or written.
    """
    name = f"{split}.{lang}"
    source = url(split, lang)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp_name = str(directory / f".{name}.{uuid.uuid4().hex}.part")
        # Made with the umask's permissions, not mkstemp's 0600: a cache that users share
        # ($TRANSFORMER_MT_CACHE) stays readable by all of them.
        fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise _cache_error(directory, e) from None
    try:
        sha = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in _downloaded_chunks(source, name, directory):
                    sha.update(chunk)
                    out.write(chunk)
        except OSError as e:  # writing or closing the file: the disk, not the download
            raise _cache_error(directory, e) from None
        if sha.hexdigest() != SHA256[name]:
            raise DataError(
                f"checksum mismatch for Multi30k {name} downloaded from {source} "
                f"(sha256 {sha.hexdigest()[:16]}..., expected {SHA256[name][:16]}...); "
                f"the file was discarded; retry later, or place verified files in {directory}"
            )
        try:
            os.replace(tmp_name, directory / name)
        except OSError as e:  # e.g. a folder by that name: the error named the temporary file
            raise DataError(
                f"cannot put Multi30k {name} in place as {directory / name} "
                f"({e.strerror or e}); remove what is there and run the same command again"
            ) from None
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return directory / name


def ensure_files(split: str, langs: tuple[str, ...]) -> tuple[Path, ...]:
    """Returns the cached Multi30k files of one split, downloading missing ones.

    Args:
      split: ``"train"``, ``"val"`` or ``"test2016"``.
      langs: language codes, e.g. ``("en", "de")``.

    Returns:
      One path per language, in order.

    Raises:
      DataError: unknown split or language, an unusable cache directory, or a
        failed download.
    """
    if split not in SPLITS:
        raise MissingSplitError(
            f"Multi30k has no split {split!r}; available splits: {', '.join(SPLITS)}"
        )
    for lang in langs:
        if lang not in LANGUAGES:
            raise DataError(f"Multi30k has no language {lang!r}; available: {', '.join(LANGUAGES)}")
    directory = cache_dir()
    paths = []
    for lang in langs:
        path = directory / f"{split}.{lang}"
        try:
            cached = path.is_file()
        except OSError as e:  # e.g. a parent without search permission
            raise _cache_error(directory, e) from None
        if not cached:
            print(f"downloading Multi30k {path.name} into {directory}", file=sys.stderr, flush=True)
            download(split, lang, directory)
        paths.append(path)
    return tuple(paths)
