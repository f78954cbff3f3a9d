"""The one-line errors the commands print for a failed system call or memory running out."""

import errno

import jax
import pytest

import data
from data.errors import os_error_line, out_of_memory_line


def test_only_a_full_disk_is_told_to_make_room():
    for code, reason in (
        (errno.EACCES, "Permission denied"),
        (errno.EROFS, "Read-only file system"),
        (errno.ENOENT, "No such file or directory"),
    ):
        error = OSError(code, reason, "/run/checkpoints")
        assert os_error_line(error, again="training resumes") == f"/run/checkpoints: {reason}"
    full = OSError(errno.ENOSPC, "No space left on device", "/run/checkpoints")
    assert os_error_line(full, again="training resumes") == (
        "/run/checkpoints: No space left on device; make room there and run the same command "
        "again (training resumes)"
    )


def test_a_full_disk_without_word_of_what_running_again_does_says_no_more():
    # evaluate.py passes no `again`: the line must not end in "(None)" or "()".
    full = OSError(errno.ENOSPC, "No space left on device", "/run/translations.txt")
    assert os_error_line(full) == (
        "/run/translations.txt: No space left on device; make room there and run the same "
        "command again"
    )


def test_an_os_error_naming_no_file_is_its_own_text():
    # Its errno number stays (strerror alone would drop it), and one without errno or
    # strerror (OSError("...")) is its message, not "None".
    assert os_error_line(OSError(errno.EACCES, "Permission denied")) == (
        "[Errno 13] Permission denied"
    )
    assert os_error_line(OSError("the lock is held by another run")) == (
        "the lock is held by another run"
    )


def test_host_memory_running_out_is_told_with_the_advice():
    assert out_of_memory_line(MemoryError("cannot allocate 8 GB"), "lower --max-tokens") == (
        "out of host memory (cannot allocate 8 GB); lower --max-tokens"
    )


def test_an_out_of_memory_error_of_several_lines_is_its_first():
    # XLA's message goes on with a list of the buffers it held.
    error = jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes.\nBuffer 1:\n  Size: 9B"
    )
    assert out_of_memory_line(error, "lower --max-tokens") == (
        "out of memory (RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes.); lower --max-tokens"
    )


def test_an_out_of_memory_line_keeps_only_the_first_200_characters_of_xlas_line():
    # XLA's first line can name every buffer's shape; the user's line stays readable.
    first = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate " + "x" * 500
    line = out_of_memory_line(jax.errors.JaxRuntimeError(first + "\nBuffer 1:"), "lower it")
    assert line == f"out of memory ({first[:200]}); lower it"


def test_xlas_older_error_name_is_out_of_memory_too():
    # jaxlib's class was XlaRuntimeError before it became JaxRuntimeError.
    xla_runtime_error = type("XlaRuntimeError", (RuntimeError,), {})
    error = xla_runtime_error("RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes.")
    assert out_of_memory_line(error, "lower it") == (
        "out of memory (RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes.); lower it"
    )


def test_an_xla_error_of_another_status_that_quotes_resource_exhausted_is_not_out_of_memory():
    # The status is the message's first word; a failure that only mentions the word is not
    # cured by a smaller batch.
    error = jax.errors.JaxRuntimeError("INTERNAL: writing the profile: RESOURCE_EXHAUSTED")
    assert out_of_memory_line(error, "lower it") is None


def test_a_missing_split_is_a_data_error(tmp_path):
    # The CLIs print a DataError as one line and exit 2 (evaluate.py --split of a split the
    # folder lacks); a MissingSplitError must be one, not a traceback.
    for lang in ("en", "de"):
        (tmp_path / f"train.{lang}").write_text("A dog.\n")
    with pytest.raises(data.DataError, match="no split 'test2017'"):
        data.load_corpus(data.CorpusSpec(data_dir=str(tmp_path)), "test2017")


@pytest.mark.parametrize(
    "error",
    [
        ValueError("RESOURCE_EXHAUSTED: Error writing: No space left on device"),  # TensorStore
        RuntimeError("RESOURCE_EXHAUSTED: quota"),
    ],
)
def test_resource_exhausted_from_elsewhere_than_xla_is_not_out_of_memory(error):
    # Else a full disk would be told to lower the batch size.
    assert out_of_memory_line(error, "lower --max-tokens") is None
