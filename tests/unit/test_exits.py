"""``pipeline.stages.exits.describe``: the failures every entry point turns into one line and an exit status."""

from __future__ import annotations

import argparse
import errno
import os

import pytest

from pipeline.stages.exits import EXIT_FAILED, EXIT_USAGE, describe
from pipeline.transport.identity import NameHeld


@pytest.mark.parametrize(("code", "what"), [
    (errno.EACCES, "Permission denied (give this process write access to it, or pass another folder)"),
    (errno.ENOSPC, "No space left on device (the disk is full: free space or pass a folder on another disk)"),
    (errno.EROFS, "Read-only file system (the file system is read-only: pass a folder on a writable one)"),
])
def test_a_file_that_cannot_be_written_is_one_line(code: int, what: str) -> None:
    e = OSError(code, os.strerror(code), "/ckpt/step-00000001")
    assert describe(e, argparse.Namespace()) == (f"cannot write /ckpt/step-00000001: {what}", EXIT_FAILED)


def test_other_os_errors_keep_their_traceback_and_a_held_name_is_a_usage_error() -> None:
    assert describe(OSError(errno.EIO, "Input/output error", "/x"), argparse.Namespace()) is None
    assert describe(OSError(errno.EACCES, "Permission denied"), argparse.Namespace()) is None  # no file named
    assert describe(NameHeld("learner consumer learner-0 rank 0 is held"), argparse.Namespace()) == (
        "learner consumer learner-0 rank 0 is held", EXIT_USAGE)
