"""Fixtures the restore tests share."""
import shutil
import tempfile

import pytest


@pytest.fixture
def dirs():
    """(a directory for a manager, a RAM-tier directory under /dev/shm)."""
    root, ram = tempfile.mkdtemp(), tempfile.mkdtemp(dir="/dev/shm")
    yield root, ram
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(ram, ignore_errors=True)
