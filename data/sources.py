"""Parallel corpora from text files, Multi30k or TFDS, normalized and cleaned.

Three sources, chosen by :class:`CorpusSpec`:

* ``files``: a directory of plain parallel files named ``{split}.{lang}``
  (``train.en`` / ``train.de`` ...), any language pair.
* ``multi30k`` (the default): the same layout, read from ``data_dir`` when given,
  else from a local cache filled on first use (see :mod:`data.multi30k`).
* ``tfds``: a TensorFlow Datasets translation dataset by name (see
  :mod:`data.tfds_source`).

Cleaning never goes silently: every skipped pair is counted by reason in a
:class:`CleaningSummary` whose one-line ``str()`` the CLIs print.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from data.errors import DataError, MissingSplitError
from data.text import is_junk, normalize, read_aligned_lines, read_lines

DATASETS = ("multi30k", "files", "tfds")


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    """Where a parallel corpus comes from.

    Attributes:
      dataset: ``"multi30k"`` | ``"files"`` | ``"tfds"``.
      data_dir: directory of ``{split}.{lang}`` files; required for ``files``,
        optional for ``multi30k`` (else the download cache), and for ``tfds``
        without ``tfds_name`` the folder that our ``ParallelTextFolder`` TFDS
        builder turns into a dataset.
      tfds_name: a TFDS dataset, e.g. ``"wmt14_translate/de-en"``.
      tfds_data_dir: where TFDS keeps downloads and prepared data (TFDS default
        ``~/tensorflow_datasets`` when None).
      src: source language code, e.g. ``"en"``.
      tgt: target language code, e.g. ``"de"``.
    """

    dataset: str = "multi30k"
    data_dir: str | None = None
    tfds_name: str | None = None
    tfds_data_dir: str | None = None
    src: str = "en"
    tgt: str = "de"

    @classmethod
    def from_settings(cls, settings: dict) -> CorpusSpec:
        """The spec of a run's "data" settings (config.json): its fields, each missing
        one at its default; other settings (vocabulary, batching) are ignored."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in settings.items() if k in fields})

    def check(self) -> None:
        """Raises DataError for settings that contradict each other (which would
        otherwise be ignored: a corpus other than the one asked for)."""
        if self.src == self.tgt:
            raise DataError(
                f"source and target language are both {self.src!r}; choose two languages"
            )
        if self.dataset != "tfds" and self.tfds_name:
            raise DataError(
                f"--tfds-name {self.tfds_name} is for --dataset tfds, not {self.dataset}; "
                "add --dataset tfds or drop --tfds-name"
            )
        if self.tfds_name and self.data_dir:
            raise DataError(
                f"--data-dir {self.data_dir} is not read with --tfds-name {self.tfds_name} "
                "(TFDS keeps its data in --tfds-data-dir); drop one of them"
            )

    def replace(self, **changes) -> CorpusSpec:
        """Returns a copy with some fields changed."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class CleaningSummary:
    """What cleaning did to one split; ``str()`` is one line for the CLI.

    Attributes:
      name: a label for the split, e.g. ``"train en-de"``.
      total: pairs read.
      kept: pairs kept.
      empty: pairs skipped because both sides are empty or whitespace.
      one_side_empty: pairs skipped because exactly one side is empty.
      junk: pairs skipped because a side has no letter or digit (``@@``).
    """

    name: str = ""
    total: int = 0
    kept: int = 0
    empty: int = 0
    one_side_empty: int = 0
    junk: int = 0

    @property
    def skipped(self) -> int:
        """Number of pairs skipped for any reason."""
        return self.empty + self.one_side_empty + self.junk

    def __str__(self) -> str:
        label = f"{self.name}: " if self.name else ""
        return (
            f"{label}{self.total} pairs read, {self.kept} kept, {self.skipped} skipped "
            f"({self.empty} empty, {self.one_side_empty} one side empty, {self.junk} junk)"
        )


@dataclasses.dataclass
class Corpus:
    """One split of a parallel corpus, normalized (and cleaned unless asked not to).

    Attributes:
      src: source sentences, normalized with :func:`data.normalize`.
      tgt: target sentences, aligned with ``src``.
      summary: what cleaning skipped.
      src_path: the raw source file, when the corpus was read from files.
      tgt_path: the raw target file (evaluation scores against it), or None.
      raw_tgt: the raw target sentences, where there is no file (TFDS) and nothing was
        cleaned away (`clean=False`), else None.
    """

    src: list[str]
    tgt: list[str]
    summary: CleaningSummary
    src_path: str | None = None
    tgt_path: str | None = None
    raw_tgt: list[str] | None = None

    def __len__(self) -> int:
        return len(self.src)

    def references(self) -> list[str]:
        """The target lines as they were given, which BLEU is scored against (sacreBLEU
        takes raw references): the target file's lines, else the raw sentences, else
        (a cleaned corpus without a file) the normalized ones."""
        if self.tgt_path:
            return read_lines(self.tgt_path)
        return list(self.raw_tgt if self.raw_tgt is not None else self.tgt)


def clean_pairs(
    src_lines: Sequence[str], tgt_lines: Sequence[str], *, clean: bool = True, name: str = ""
) -> Corpus:
    """Normalizes aligned raw sentences and, if ``clean``, skips bad pairs.

    Args:
      src_lines: raw source sentences.
      tgt_lines: raw target sentences, same length.
      clean: skip empty, one-sided and junk pairs (training); False keeps every
        line (evaluation, so line counts match the references).
      name: label for the summary.

    Returns:
      A :class:`Corpus` without file paths.
    """
    if len(src_lines) != len(tgt_lines):
        raise DataError(
            f"{name or 'corpus'}: {len(src_lines)} source lines but {len(tgt_lines)} target lines"
        )
    summary = CleaningSummary(name=name, total=len(src_lines))
    src, tgt = [], []
    for raw_x, raw_y in zip(src_lines, tgt_lines, strict=True):
        x, y = normalize(raw_x), normalize(raw_y)
        if clean:
            if not x and not y:
                summary.empty += 1
                continue
            if not x or not y:
                summary.one_side_empty += 1
                continue
            if is_junk(x) or is_junk(y):
                summary.junk += 1
                continue
        src.append(x)
        tgt.append(y)
    summary.kept = len(src)
    raw_tgt = None if clean else list(tgt_lines)  # aligned: nothing was skipped
    return Corpus(src=src, tgt=tgt, summary=summary, raw_tgt=raw_tgt)


def read_parallel(
    src_path: str | os.PathLike, tgt_path: str | os.PathLike, *, clean: bool = True
) -> Corpus:
    """Reads two aligned text files (one sentence per line) into a corpus.

    Args:
      src_path: source-language file.
      tgt_path: target-language file.
      clean: see :func:`clean_pairs`.

    Returns:
      The corpus, with ``src_path``/``tgt_path`` set.

    Raises:
      DataError: a file is missing, not UTF-8, or the line counts differ
        (the message names both files and both counts).
    """
    src_lines, tgt_lines = read_aligned_lines(src_path, tgt_path)
    name = f"{Path(src_path).name} / {Path(tgt_path).name}"
    corpus = clean_pairs(src_lines, tgt_lines, clean=clean, name=name)
    corpus.src_path, corpus.tgt_path = str(src_path), str(tgt_path)
    return corpus


def folder_splits(data_dir: str | os.PathLike, src: str, tgt: str) -> list[str]:
    """Splits for which ``data_dir`` has both ``{split}.{src}`` and ``{split}.{tgt}``.

    Args:
      data_dir: a directory of ``{split}.{lang}`` files.
      src: source language code.
      tgt: target language code.

    Returns:
      Sorted split names.
    """
    d = Path(data_dir)
    if not d.is_dir():
        return []
    return sorted(
        p.name[: -len(src) - 1]
        for p in d.glob(f"*.{src}")
        if (d / f"{p.name[: -len(src)]}{tgt}").is_file()
    )


def _read_folder_split(
    data_dir: str | os.PathLike, spec: CorpusSpec, split: str, clean: bool
) -> Corpus:
    return read_parallel(*folder_split_files(data_dir, spec, split), clean=clean)


def folder_split_files(
    data_dir: str | os.PathLike, spec: CorpusSpec, split: str
) -> tuple[Path, Path]:
    """The ``{split}.{src}`` and ``{split}.{tgt}`` files of a folder, both there.

    Args:
      data_dir: a directory of ``{split}.{lang}`` files.
      spec: the :class:`CorpusSpec` (its ``src`` and ``tgt``).
      split: the split's name.

    Raises:
      MissingSplitError: neither file is there (the message lists the splits that are).
      DataError: the folder is missing, or one of the two files is (a split one file
        short, or a language the folder has no files for).
    """
    d = Path(data_dir)
    if not d.is_dir():
        what = "is a file, not a directory" if d.exists() else "not found"
        raise DataError(
            f"data directory {d} {what}; "
            "pass --data-dir pointing at a folder of {split}.{lang} files"
        )
    src_path, tgt_path = d / f"{split}.{spec.src}", d / f"{split}.{spec.tgt}"

    def there(path: Path) -> bool:  # os.path.lexists, which says False for "cannot look"
        try:
            os.lstat(path)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise DataError(
                f"cannot look into the data directory {d} ({e.strerror or e}); "
                "fix its permissions or pass another --data-dir"
            ) from None
        return True

    # Only files that are not there make a missing split: a broken link or a folder in
    # their place is an error that read_parallel names.
    if not there(src_path) and not there(tgt_path):
        available = folder_splits(d, spec.src, spec.tgt)
        gzipped = [f"{p.name}.gz" for p in (src_path, tgt_path) if Path(f"{p}.gz").is_file()]
        advice = f"; decompress {' and '.join(gzipped)} (gunzip)" if gzipped else ""
        raise MissingSplitError(
            f"no split {split!r} for {spec.src}-{spec.tgt} in {d} "
            f"(no {src_path.name} / {tgt_path.name}); "
            f"available splits: {', '.join(available) or 'none'}{advice}"
        )
    for path, other in ((src_path, tgt_path), (tgt_path, src_path)):
        if not there(path):
            langs = sorted(p.suffix[1:] for p in d.glob(f"{split}.*"))
            lang = path.suffix[1:]
            # A language the folder has for other splits is the right one, one file short.
            elsewhere = sorted(p.name[: -len(lang) - 1] for p in d.glob(f"*.{lang}"))
            advice = (
                f"add {path.name} (the folder has {lang} files for: {', '.join(elsewhere)}), "
                f"or remove {other.name} if there is no {split} split"
                if elsewhere
                else "choose the languages with --src and --tgt"
            )
            raise DataError(
                f"no {path.name} in {d} (its {split} files are in: {', '.join(langs)}); {advice}"
            )
    return src_path, tgt_path


def load_corpus(spec: CorpusSpec, split: str, *, clean: bool = True) -> Corpus:
    """Loads one split of the corpus that ``spec`` names.

    Args:
      spec: which dataset and language pair.
      split: ``"train"``, ``"val"``, ``"test2016"`` or any split the source has
        (for TFDS, ``"val"`` also finds ``"validation"``).
      clean: True for training (skip and count bad pairs); False keeps every
        line, normalized, so translations align with the reference file.

    Returns:
      The normalized corpus and its cleaning summary.

    Raises:
      MissingSplitError: the corpus has no such split (the message lists the
        available splits).
      DataError: unknown dataset, missing or malformed files, no network for a
        first download.
    """
    spec.check()
    if spec.dataset == "files":
        if not spec.data_dir:
            raise DataError("dataset 'files' needs --data-dir, a folder of {split}.{lang} files")
        corpus = _read_folder_split(spec.data_dir, spec, split, clean)
    elif spec.dataset == "multi30k":
        from data import multi30k

        if spec.data_dir:
            corpus = _read_folder_split(spec.data_dir, spec, split, clean)
        else:
            src_path, tgt_path = multi30k.ensure_files(split, (spec.src, spec.tgt))
            corpus = read_parallel(src_path, tgt_path, clean=clean)
    elif spec.dataset == "tfds":
        from data import tfds_source

        src_lines, tgt_lines = tfds_source.load_split(spec, split)
        corpus = clean_pairs(
            src_lines, tgt_lines, clean=clean, name=f"{split} {spec.src}-{spec.tgt}"
        )
    else:
        raise DataError(f"unknown dataset {spec.dataset!r}; choose one of {', '.join(DATASETS)}")
    corpus.summary.name = f"{split} {spec.src}-{spec.tgt}"
    return corpus
