"""TensorFlow Datasets translation corpora, read without TensorFlow.

Any TFDS translation dataset (``wmt14_translate/de-en``,
``ted_hrlr_translate/pt_to_en``, ...) is downloaded and prepared by TFDS itself
(its own download manager, checksums and cache in ``tfds_data_dir``), in the
ArrayRecord file format, and read back with ``builder.as_data_source``, which
needs neither TensorFlow nor ``tf.data``. A dataset someone already prepared
in TFRecord format is read through ``tf.data`` and then does need TensorFlow.

For local files, :func:`folder_builder` makes a TFDS dataset out of a directory
of ``{split}.{lang}`` files (TFDS's own ``TranslateFolder`` requires
TensorFlow), which is how the TFDS path is exercised offline in the tests.

Install with ``pip install 'transformer-mt[tfds]'`` (tensorflow-datasets and
array-record).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from data.errors import DataError, MissingSplitError
from data.text import is_a_terminal

# Conventional names of our splits in TFDS datasets.
SPLIT_ALIASES = {"val": "validation", "valid": "validation", "dev": "validation"}
# Whether TFDS may draw its download and preparation bars (where stderr is a terminal):
# train.py and evaluate.py turn them off with --no-progress (`show_progress_bars`).
_progress_bars = True


def show_progress_bars(enabled: bool) -> None:
    """Whether TFDS draws its bars while it downloads and prepares a dataset; only ever
    where stderr is a terminal, since into a log file each redraw only lengthens a line."""
    global _progress_bars
    _progress_bars = enabled


class _NotOurConfigWarning:
    """Drops TFDS's warning that a builder has a custom configuration: every folder
    builder has one (its files' hash), so the warning said nothing, three times a run."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("Using custom data configuration")


def _import_tfds() -> Any:
    try:
        import tensorflow_datasets as tfds
        import tensorflow_datasets.translate  # noqa: F401  registers wmt*_translate (lazily imported otherwise)
    except ImportError as e:
        raise DataError(
            f"the tfds dataset needs TensorFlow Datasets ({e}); "
            "install it with pip install 'transformer-mt[tfds]'"
        ) from None
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _NotOurConfigWarning) for f in absl.filters):
        absl.addFilter(_NotOurConfigWarning())
    return tfds


@functools.cache
def _folder_builder_class() -> type:
    tfds = _import_tfds()

    class ParallelTextFolder(tfds.core.GeneratorBasedBuilder):
        """A TFDS dataset made of the ``{split}.{lang}`` files of one folder, in file order."""

        VERSION = tfds.core.Version("1.0.0")

        def __init__(self, *, root: str, languages: tuple[str, str], splits: list[str], **kwargs):
            self._root, self._languages, self._splits = Path(root), languages, splits
            super().__init__(**kwargs)

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                description=f"Parallel text files {{split}}.{{lang}} from {self._root}.",
                features=tfds.features.Translation(languages=list(self._languages)),
                supervised_keys=self._languages,
                # File order, so that evaluation output lines up with the reference file.
                disable_shuffling=True,
            )

        def _split_generators(self, dl_manager):
            del dl_manager  # local files: nothing to download
            return {split: self._generate_examples(split) for split in self._splits}

        def _generate_examples(self, split):
            from data.text import read_aligned_lines

            files = [self._root / f"{split}.{lang}" for lang in self._languages]
            columns = read_aligned_lines(*files)
            for i, pair in enumerate(zip(*columns, strict=True)):
                yield i, dict(zip(self._languages, pair, strict=True))

    return ParallelTextFolder


def folder_builder(
    root: str | os.PathLike, src: str, tgt: str, *, data_dir: str | None = None
) -> Any:
    """A TFDS builder for the ``{split}.{src}`` / ``{split}.{tgt}`` files of a folder.

    The builder's config name carries a hash of the files' content, so editing
    a file makes TFDS prepare a fresh copy instead of serving stale data.

    Args:
      root: the folder of parallel text files.
      src: source language code.
      tgt: target language code.
      data_dir: where TFDS writes the prepared dataset (TFDS default if None).

    Returns:
      A ``tfds.core.GeneratorBasedBuilder`` (``parallel_text_folder``).
    """
    from data.sources import folder_splits

    root = Path(root).expanduser().resolve()
    splits = folder_splits(root, src, tgt)
    if not splits:
        raise DataError(f"no {{split}}.{src} / {{split}}.{tgt} file pairs in {root}")
    digest = hashlib.sha256()
    for split in splits:
        for lang in (src, tgt):
            digest.update(f"{split}.{lang}\0".encode())
            with open(root / f"{split}.{lang}", "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
    tfds = _import_tfds()
    config = tfds.core.BuilderConfig(name=f"{src}-{tgt}-{digest.hexdigest()[:16]}")
    return _folder_builder_class()(
        root=str(root),
        languages=(src, tgt),
        splits=splits,
        config=config,
        data_dir=data_dir,
        file_format="array_record",
    )


def _registered_builder(tfds: Any, name: str, data_dir: str | None) -> Any:
    try:
        return tfds.builder(name, data_dir=data_dir, file_format="array_record")
    except Exception as e:  # noqa: BLE001  TFDS raises several types for unknown names/configs
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"unknown TFDS dataset {name!r} ({first_line}); see https://www.tensorflow.org/datasets/catalog"
        ) from None


class _UnresolvedHost(Exception):
    """A download host that has not resolved for `UNRESOLVED_GIVE_UP_S`. Not an OSError,
    so that urllib3 does not retry it (TFDS's downloader retries 10 times with backoff,
    3.4 minutes offline)."""

    def __init__(self, host: str):
        super().__init__(host)
        self.host = host


# How long a host may fail to resolve, from its first failure with no success since,
# before a TFDS download gives up on it: with TFDS's backoff (0, 0.4, 0.8, 1.6, 3.2,
# 6.4 s, ...) that is the lookup about 12 s in, where all 10 retries took 205 s.
UNRESOLVED_GIVE_UP_S = 10.0

_resolver_lock = threading.Lock()
_resolver_users = 0
_resolve = socket.getaddrinfo  # the one the wrapper calls, while it is installed
_failing_since: dict[str, float] = {}


def _getaddrinfo(host, *args, **kwargs):
    """`socket.getaddrinfo`, which gives up on a host that has not resolved for a while."""
    try:
        addresses = _resolve(host, *args, **kwargs)
    except socket.gaierror:
        now = time.monotonic()
        with _resolver_lock:
            first = _failing_since.setdefault(str(host), now)
        if now - first >= UNRESOLVED_GIVE_UP_S:
            raise _UnresolvedHost(str(host)) from None
        raise
    with _resolver_lock:
        _failing_since.pop(str(host), None)
    return addresses


@contextlib.contextmanager
def _no_retries_for_unresolved_hosts() -> Iterator[None]:
    """While in the block, a host name that has failed to resolve for
    `UNRESOLVED_GIVE_UP_S` with no success between raises :class:`_UnresolvedHost`, which
    urllib3 does not retry: an offline machine fails in about 12 s instead of after
    TFDS's whole backoff, and a DNS outage shorter than that is still ridden out.

    `socket.getaddrinfo` is replaced for the whole process meanwhile; blocks may overlap
    (other threads), and the last to leave puts the original back.
    """
    global _resolver_users, _resolve
    with _resolver_lock:
        if _resolver_users == 0:
            _resolve, socket.getaddrinfo = socket.getaddrinfo, _getaddrinfo
            _failing_since.clear()
        _resolver_users += 1
    try:
        yield
    finally:
        with _resolver_lock:
            _resolver_users -= 1
            if _resolver_users == 0:
                socket.getaddrinfo = _resolve


def _prepare(builder: Any, label: str) -> None:
    _import_tfds().display_progress_bar(_progress_bars and is_a_terminal(sys.stderr))
    try:
        with _no_retries_for_unresolved_hosts():
            builder.download_and_prepare()
    except DataError:
        raise
    except _UnresolvedHost as e:
        raise DataError(
            f"TFDS could not download {label}: the host {e.host} has not resolved for "
            f"{UNRESOLVED_GIVE_UP_S:g} s (offline?); "
            "if offline, use --dataset files --data-dir with {split}.{lang} text files, "
            "or --tfds-data-dir with a prepared copy"
        ) from None
    except Exception as e:  # noqa: BLE001  network, manual-download and disk errors surface as many types
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        if "No examples were yielded" in reason:  # not a download: empty files of a folder
            raise DataError(
                f"TFDS found no sentence pairs for {label} ({reason}); "
                "each split's {split}.{lang} files need at least one line"
            ) from None
        raise DataError(
            f"TFDS could not download/prepare {label}: {reason}; if offline, use --dataset files "
            "--data-dir with {split}.{lang} text files, or --tfds-data-dir with a prepared copy"
        ) from None


def _examples(builder: Any, split: str) -> Any:
    file_format = getattr(builder.info, "file_format", None)
    if str(getattr(file_format, "value", file_format)) == "array_record":
        return builder.as_data_source(split=split)
    try:  # prepared elsewhere as TFRecord: only tf.data can read it
        return builder.as_dataset(split=split).as_numpy_iterator()
    except ImportError:
        raise DataError(
            f"{builder.data_dir} holds TFRecord files, which need TensorFlow: "
            "pip install tensorflow, "
            "or delete that folder so it is prepared again as ArrayRecord"
        ) from None


def _language_advice(builder: Any, spec: Any) -> str:
    """What to do when the dataset lacks a language: other languages, or, for a name
    without a config, which config TFDS chose and the ones that have both languages."""
    configs = [c.name for c in getattr(builder, "BUILDER_CONFIGS", None) or []]
    if not spec.tfds_name or "/" in spec.tfds_name or not configs:
        return "choose them with --src/--tgt"
    name = spec.tfds_name.split(":")[0]
    both = [c for c in configs if {spec.src, spec.tgt} <= set(re.split(r"[^a-z]+", c.lower()))]
    return (
        f"TFDS chose its default config, {builder.builder_config.name}: choose one with "
        f"--tfds-name {name}/CONFIG ({', '.join(both or configs)}), or other --src/--tgt"
    )


def _known_splits(builder: Any) -> list[str]:
    """The split names a builder declares before it is prepared: those of a prepared
    copy's info, else the WMT builders' subsets; [] when only preparing tells."""
    names = list(builder.info.splits.keys()) or list(getattr(builder, "subsets", None) or [])
    return [str(name) for name in names]


def _split_name(available: list[str], split: str, label: str) -> str:
    """The TFDS name of `split` among `available` (`val` also finds `validation`).

    Raises:
      MissingSplitError: `available` has neither name.
    """
    name = split if split in available else SPLIT_ALIASES.get(split, split)
    if name not in available:
        raise MissingSplitError(
            f"{label} has no split {split!r}; available splits: {', '.join(sorted(available))}"
        )
    return name


def load_split(spec: Any, split: str) -> tuple[list[str], list[str]]:
    """Reads one split of a TFDS translation dataset as raw source/target sentences.

    Args:
      spec: a :class:`data.CorpusSpec` with ``dataset="tfds"`` and either
        ``tfds_name`` (a registered dataset) or ``data_dir`` (a folder of
        ``{split}.{lang}`` files turned into a TFDS dataset).
      split: split name; ``"val"`` also finds TFDS's ``"validation"``.

    Returns:
      ``(src_sentences, tgt_sentences)``, raw (not yet normalized).

    Raises:
      DataError: TFDS missing, unknown dataset/split/language, download failure.
    """
    tfds = _import_tfds()
    if spec.tfds_name:
        builder, label = (
            _registered_builder(tfds, spec.tfds_name, spec.tfds_data_dir),
            spec.tfds_name,
        )
    elif spec.data_dir:
        from data.sources import folder_split_files, folder_splits

        # A split one file short is an error, as for --dataset files: the builder's splits
        # leave it out, and a validation split was then skipped with a warning.
        available = folder_splits(spec.data_dir, spec.src, spec.tgt)
        if available and not {split, SPLIT_ALIASES.get(split)} & set(available):
            with contextlib.suppress(MissingSplitError):  # neither file: said below
                folder_split_files(spec.data_dir, spec, split)
        builder = folder_builder(spec.data_dir, spec.src, spec.tgt, data_dir=spec.tfds_data_dir)
        label = f"{spec.data_dir} (as a TFDS dataset)"
    else:
        raise DataError(
            "dataset 'tfds' needs --tfds-name (e.g. wmt14_translate/de-en) "
            "or --data-dir with {split}.{lang} files"
        )
    languages = (
        sorted(builder.info.features.keys()) if hasattr(builder.info.features, "keys") else []
    )
    missing = [lang for lang in (spec.src, spec.tgt) if lang not in languages]
    if missing:
        raise DataError(
            f"{label} has no language {missing[0]!r}; its languages are {', '.join(languages)} "
            f"({_language_advice(builder, spec)})"
        )
    # Checked before preparing too where the splits are known without it (WMT's subsets),
    # so that a misnamed split is not reported after a download of gigabytes.
    if known := _known_splits(builder):
        _split_name(known, split, label)
    _prepare(builder, label)
    name = _split_name(list(builder.info.splits.keys()), split, label)
    src, tgt = [], []
    for example in _examples(builder, name):
        x, y = example[spec.src], example[spec.tgt]
        src.append(x.decode("utf-8") if isinstance(x, bytes) else str(x))
        tgt.append(y.decode("utf-8") if isinstance(y, bytes) else str(y))
    return src, tgt
