"""Draws the saved JSON lines of an earlier bench run (a helper: run_all.py skips _*.py).

    python bench/_plot.py results.jsonl docs/benchmarks_save_restore.png
    python bench/_plot.py --scaling runs.jsonl docs/benchmarks_scaling.png

reads the JSON lines a bench script printed (save_restore, gcs or recovery)
and draws them with harness.plot (see its docstring for what each plot
shows); `--scaling`: save_restore lines of several sizes, time against state
size on log-log axes. Needs matplotlib (the [bench] extra).
"""
from __future__ import annotations

import sys

from harness.plot import plot
from harness.report import read_jsonl


def main(argv: list[str]) -> int:
    scaling = argv[:1] == ["--scaling"]
    argv = argv[1:] if scaling else argv
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return 0 if plot(read_jsonl(argv[0]), argv[1], scaling) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
