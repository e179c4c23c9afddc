"""Runs every bench script in turn and passes their JSON lines through.

    python bench/run_all.py            # every script with --quick (a check)
    python bench/run_all.py --quick    # the same
    python bench/run_all.py --full     # every script at its full default sizes
    python bench/run_all.py --repeats 5 --sizes 2GB   # these arguments, passed through

Every `bench/*.py` except this one and helpers named `_*.py` runs in its own
process; bench/harness/ (a package, not a script) is not run. Their stdout
lines (one JSON object each, docs/bench_contract.md) are forwarded to stdout
as they come; a line that is not a JSON object goes to
stderr with a warning. Their stderr (logs) passes through. The exit status is 0
when every script succeeded, else 1, after all have run.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

from harness.report import emit


def scripts(here: str) -> list[str]:
    me = os.path.abspath(__file__)
    return [p for p in sorted(glob.glob(os.path.join(here, "*.py")))
            if os.path.abspath(p) != me and not os.path.basename(p).startswith("_")]


def run(script: str, args: list[str]) -> int:
    name = os.path.basename(script)
    sys.stderr.write(f"run_all: {name} {' '.join(args)}\n")
    proc = subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE,
                            text=True, bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        text = line.strip()
        if not text:
            continue
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            sys.stderr.write(f"run_all: {name} printed a line that is not a JSON object: "
                             f"{text}\n")
            continue
        emit(obj)
    rc = proc.wait()
    if rc:
        sys.stderr.write(f"run_all: {name} failed with exit status {rc}\n")
    return rc


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not argv:
        args = ["--quick"]
    elif argv == ["--full"]:
        args = []
    else:
        args = [a for a in argv if a != "--full"]
    failed = [s for s in scripts(os.path.dirname(os.path.abspath(__file__)))
              if run(s, args) != 0]
    if failed:
        sys.stderr.write(f"run_all: failed: {', '.join(map(os.path.basename, failed))}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
