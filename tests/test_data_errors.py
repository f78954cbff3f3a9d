"""The one-line errors the commands print for a failed system call or memory running out."""

import errno

import jax
import pytest

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


def test_an_out_of_memory_error_of_several_lines_is_its_first():
    # XLA's message goes on with a list of the buffers it held.
    error = jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes.\nBuffer 1:\n  Size: 9B"
    )
    assert out_of_memory_line(error, "lower --max-tokens") == (
        "out of memory (RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes.); lower --max-tokens"
    )


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
