"""Reading raw text files and normalizing sentences.

Every sentence that reaches the tokenizer, whether for training, evaluation or
translation, goes through :func:`normalize`, so the model never sees two
spellings of the same text.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import unicodedata
import uuid
from collections.abc import Callable
from pathlib import Path

from data.errors import DataError

# Multi30k (like many web-crawled corpora) contains a few XML-escaped
# ampersands (`&amp;` in 16 lines of train.en) next to raw `&` in the aligned
# German lines and in all val/test files. We unescape exactly the five XML
# entities so training data, translation input and references agree on `&`.
# A general HTML unescape is deliberately avoided: it also rewrites text such
# as `&copy` or `&lt` without a semicolon, which do occur in legitimate text.
_XML_ENTITIES = {"&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&apos;": "'", "&#39;": "'"}
_XML_ENTITY_RE = re.compile("|".join(re.escape(e) for e in _XML_ENTITIES))

# Invisible characters that NFKC keeps but that carry no content in MT data
# (2 zero-width spaces in Multi30k's train.cs). Zero-width (non-)joiners are
# kept: they are meaningful in Indic and Arabic scripts.
_INVISIBLE_RE = re.compile("[\u200b\ufeff\u00ad\u2060]")

NORMALIZATION_VERSION = 1  # part of the token cache key: bump when normalize() changes


def normalize(text: str) -> str:
    """Normalizes one sentence for training and translation alike.

    Steps, in order: zero-width spaces, byte-order marks, soft hyphens and
    control characters are removed; Unicode NFKC is applied (folds no-break
    spaces, full-width forms, ligatures); the five XML entities (``&amp;``
    ...) are unescaped, repeatedly, so double-escaped ``&amp;amp;`` also
    becomes ``&``, and NFKC is applied again where they were (``&lt;`` and a
    combining U+0338 make one ``≮``); every run of whitespace (tabs included)
    becomes a single space, with none at either end. The order makes the
    function idempotent: ``normalize(normalize(s)) == normalize(s)``.

    Args:
      text: a raw sentence.

    Returns:
      The normalized sentence (possibly empty).
    """
    text = _INVISIBLE_RE.sub("", text)
    if not text.isprintable():  # fast path: most lines have no control characters
        text = "".join(c for c in text if c.isspace() or unicodedata.category(c) != "Cc")
    text = unicodedata.normalize("NFKC", text)
    unescaped = text
    while "&" in unescaped:
        once = _XML_ENTITY_RE.sub(lambda m: _XML_ENTITIES[m.group(0)], unescaped)
        if once == unescaped:
            break
        unescaped = once
    if unescaped != text:  # an unescaped "<" can compose with what follows: "&lt;\u0338"
        text = unicodedata.normalize("NFKC", unescaped)
    return " ".join(text.split())


def is_junk(text: str) -> bool:
    """Whether a non-empty normalized sentence has no letter or digit at all.

    Such lines (``@@`` twice in Multi30k's train.de, lone punctuation) are
    alignment debris, not translations.

    Args:
      text: a normalized sentence.

    Returns:
      True when ``text`` contains no alphanumeric character.
    """
    return not any(c.isalnum() for c in text)


def read_lines(path: str | os.PathLike) -> list[str]:
    """Reads a UTF-8 text file as a list of raw lines.

    Lines are split on ``\\n`` only (``str.splitlines`` would also split on
    form feeds, U+2028 and friends, and silently misalign parallel files); a
    trailing ``\\r`` is dropped.

    Args:
      path: the file to read.

    Returns:
      The lines, without line terminators.

    Raises:
      DataError: the file is missing or unreadable, or it is not valid UTF-8
        (the message names the file and the line).
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        if os.path.islink(path):  # data on a drive that is not mounted, a moved folder
            raise DataError(
                f"{path} is a link to {os.readlink(path)}, which is not there; "
                "mount or restore its target, or replace the link"
            ) from None
        raise DataError(f"file not found: {path}") from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    return decode_lines(raw, str(path))


def decode_lines(raw: bytes, name: str, first_line: int = 1) -> list[str]:
    """The lines of UTF-8 bytes, as :func:`read_lines` splits them.

    Args:
      raw: the bytes of a file or of standard input.
      name: what to call them in an error (a path, "standard input").
      first_line: the number of their first line in `name`, for an error (where they
        are one line of several read one at a time).

    Returns:
      The lines, without line terminators.

    Raises:
      DataError: the bytes are gzip-compressed, UTF-16 or not valid UTF-8, or
        their lines end with a carriage return alone.
    """
    if raw.startswith(b"\x1f\x8b"):  # gzip's magic bytes (Multi30k's upstream files are .gz)
        raise DataError(f"{name} is gzip-compressed, not text; decompress it (gunzip, zcat)")
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DataError(
            f"{name} is UTF-16 (it starts with a UTF-16 byte-order mark); "
            "convert it to UTF-8 (e.g. iconv -f utf-16 -t utf-8)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + first_line
        raise DataError(
            f"{name}, line {line}: invalid UTF-8 ({e.reason} at byte {e.start}); "
            "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None
    if text.startswith("\ufeff"):  # a UTF-8 byte-order mark is not part of the first line
        text = text[1:]
    lone_carriage_returns = len(re.findall("\r(?!\n)", text.rstrip("\r\n")))
    if lone_carriage_returns > text.count("\n"):
        # Classic Mac OS line ends (a final \n added or not): read as one line, every
        # sentence would become one pair. A stray \r inside a line of a \n file stays.
        raise DataError(
            f"{name} ends its lines with a carriage return (\\r) alone; "
            "convert them to \\n (e.g. tr '\\r' '\\n')"
        )
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


# Names of a file that a process has open: /dev/stdout, /dev/fd/N, /proc/self/fd/N.
_DESCRIPTOR_NAME_RE = re.compile(r"/dev/(stdin|stdout|stderr|fd/\d+)|/proc/(self|\d+)/fd/\d+")


def names_an_open_file(path: str | os.PathLike) -> bool:
    """Whether `path`, or a link on the way from it, is a name such as /dev/stdout or
    /dev/fd/N for a file a process has open: where a shell sent that output to a regular
    file (`> log`, `>> log`), replacing the file would take it from the shell's output,
    and opening it to write anew would cut off what was written to it before."""
    path, seen = Path(os.path.abspath(path)), set()
    while path not in seen:
        if _DESCRIPTOR_NAME_RE.fullmatch(str(path)):
            return True
        if not path.is_symlink():
            return False
        seen.add(path)
        path = Path(os.path.abspath(path.parent / os.readlink(path)))
    return False  # a loop of links


def is_a_terminal(stream) -> bool:
    """Whether `stream` (sys.stderr, say) is a terminal: where a progress bar can be
    redrawn; into a log file each redraw only lengthens one long line."""
    return stream is not None and stream.isatty()


def discard_writes(fds: list[int]) -> None:
    """Points the file descriptors `fds` at /dev/null: what is written to them from now on
    goes nowhere, where writing to what they were would fail (a terminal that hung up, a
    pipe whose reader ended)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in fds:
            os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def is_written_in_place(path: str | os.PathLike) -> bool:
    """Whether `write_text_atomically` writes straight into `path`: something that is
    there and is not a regular file (a device, a pipe, or a link to one), or a name of
    an open file such as /dev/stdout (`names_an_open_file`)."""
    path = Path(path)
    return path.exists() and (not path.is_file() or names_an_open_file(path))


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Writes UTF-8 `text` to `path` (parent folders made) through a temporary file
    beside it, so that an interrupted write leaves the old file or none, never half.

    A symbolic link is written through, to the file it points to, which keeps its
    permissions. Something there that is not a regular file, such as a pipe, is
    written to directly: it cannot be replaced, and must not be. So is a name of an
    open file such as /dev/stderr, appended to: what was written there before stays.

    Raises:
      OSError: the file cannot be written; its filename is `path`, not the
        temporary file's.
    """
    mode = "a" if names_an_open_file(path) else "w"

    def write(file: Path) -> None:
        with open(file, mode, encoding="utf-8") as f:
            f.write(text)

    write_atomically(path, write)


def write_atomically(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """`write(file)` for `path`, as `write_text_atomically` writes text: to a temporary
    file beside it that then replaces it (to `path` itself where that is a device or a
    pipe), so that an interrupted write leaves the old file or none, never half, and
    writers that overlap (hosts sharing a workdir) each replace it with a whole file.

    Raises:
      OSError: the file cannot be written; its filename is `path`.
    """
    path = Path(path)
    if is_written_in_place(path):
        try:
            write(path)
        except OSError as e:  # a full device: the error names no file otherwise
            raise OSError(e.errno, e.strerror, str(path)) from None
        return
    path = Path(os.path.realpath(path))  # a link's target, so the link stays a link
    # A name of its own: a process id is not unique among hosts writing to one workdir.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        if path.exists():
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        with contextlib.suppress(OSError):  # none was made where the folder is not one
            tmp.unlink(missing_ok=True)


def read_aligned_lines(*paths: str | os.PathLike) -> list[list[str]]:
    """Reads files whose line i go together (a source and its translation, ...).

    Args:
      *paths: the files, each read with :func:`read_lines`.

    Returns:
      Their lines, one list per file, all of one length.

    Raises:
      DataError: a file is missing, unreadable or not UTF-8, or the line counts
        differ (the message names every file with its count).
    """
    columns = [read_lines(path) for path in paths]
    if len({len(lines) for lines in columns}) > 1:
        counts = ", ".join(f"{p} has {len(c)} lines" for p, c in zip(paths, columns, strict=True))
        raise DataError(
            f"files that must be aligned line by line differ in length: {counts}; "
            "line i of each must go with line i of the others"
        )
    return columns
