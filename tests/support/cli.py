"""Running the `resilient-ckpt` tool from tests: in-process through `main()`
(fast), or the installed console script in a subprocess."""
from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys

from resilient_ckpt.cli.main import main

BIN = pathlib.Path(sys.executable).with_name("resilient-ckpt")


def run(*args, code=0, env=None, installed=False):
    """The tool's result (returncode, stdout, stderr), asserted to exit `code`."""
    argv = [str(a) for a in args]
    if installed or env:
        cmd = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "resilient_ckpt.cli.main"]
        p = subprocess.run(cmd + argv, capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, **(env or {})))
    else:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse's refusals
                rc = e.code if isinstance(e.code, int) else int(e.code is not None)
        p = subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    return p


def js(*args, code=0, env=None, installed=False):
    """The tool's --json output, parsed."""
    return json.loads(run(*args, "--json", code=code, env=env, installed=installed).stdout)
