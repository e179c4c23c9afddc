"""What `resilient-ckpt` prints never carries a terminal escape from the
directory it reads: file names, claims, the tiers record and manifests are
written by whoever can write the directory, and their control characters
(ESC sequences that retitle the window, clear the screen or rewrite earlier
lines; bidi overrides; bytes that are not UTF-8) reach the terminal escaped,
as `\\x1b`, `\\u202e`, `\\udcff`. `--json` output is JSON (ensure_ascii), so
escaped already.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np
import orbax.checkpoint as ocp
import pytest

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, LocalTier
from resilient_ckpt.cli.main import safe
from resilient_ckpt.core import layout
from resilient_ckpt.save.tierrecord import RECORD_NAME
from tests.support.cli import run

EVIL = "\x1b]0;owned\x07\x1b[2J\u202e\x9b"
RAW = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]")  # a newline ends each line


def assert_clean(text: str) -> None:
    bad = RAW.findall(text)
    assert not bad, (bad, text)


def test_safe_escapes_control_characters_and_keeps_the_rest():
    assert safe("step 3: ok, naïve 日本") == "step 3: ok, naïve 日本"
    assert safe(EVIL) == "\\x1b]0;owned\\x07\\x1b[2J\\u202e\\x9b"
    assert safe("a\nb\tc\rd\x00") == "a\\nb\\tc\\rd\\x00"
    assert safe(os.fsdecode(b"name\xff")) == "name\\udcff"  # not UTF-8: printable now
    assert safe("back\\slash") == "back\\slash"


@pytest.fixture
def hostile(tmp_path):
    """A directory holding step 1, and step 2 uncommitted, with hostile text
    in a leaf's key, in a claim's host, a write marker's and a dead writer's
    temporary's name (in step 3), and in the tiers record."""
    d = str(tmp_path / "c")
    with CheckpointManager(d, options=CheckpointManagerOptions(tiers=(LocalTier(),))) as m:
        for s in (1, 2):
            m.save(s, args=ocp.args.StandardSave({EVIL: np.arange(4), "ok": s}))
    step2 = os.path.join(d, "2")
    os.remove(os.path.join(step2, layout.manifest_name(0, 1)))  # uncommitted now
    claim = os.path.join(step2, layout.claim_name(0, 1))
    with open(claim, "w") as f:
        json.dump({"save_id": "e" * 32, "host": EVIL, "pid": 1, "start": 2}, f)
    with open(os.path.join(step2, f".writing.{EVIL}.1.2"), "wb") as f:
        f.write(b"x")
    step3 = os.path.join(d, "3")  # only a dead writer's temporary: gc's to remove
    os.mkdir(step3)
    with open(os.path.join(step3, f"{EVIL}.tmp.{layout.Writer.me().host}.999999999.1.ab"),
              "wb") as f:
        f.write(b"x")
    rec = os.path.join(d, RECORD_NAME)
    with open(rec) as f:
        doc = json.load(f)
    doc["tiers"][0]["name"] = "local" + EVIL
    with open(rec, "w") as f:
        json.dump(doc, f)
    return d


@pytest.mark.parametrize("argv", [["ls"], ["inspect", "1"],
                                  ["verify", "-q"], ["gc"], ["gc", "--apply"]])
def test_nothing_hostile_reaches_the_terminal(hostile, argv):
    p = run(argv[0], hostile, *argv[1:], code=1 if argv[0] == "verify" else 0)
    assert_clean(p.stdout)
    assert_clean(p.stderr)
    assert "\\x1b" in p.stdout, p.stdout  # shown, escaped


def test_error_messages_are_escaped_too(tmp_path):
    d = tmp_path / ("x" + EVIL)
    p = run("ls", d, code=2)
    assert_clean(p.stderr)
    assert "\\x1b" in p.stderr


def test_warnings_logged_while_reading_are_escaped(tmp_path):
    """A tier whose very path holds escapes, with a torn manifest in it: the
    reader's warning names the path, and reaches stderr escaped."""
    d = str(tmp_path / ("t" + EVIL))
    with CheckpointManager(d, options=CheckpointManagerOptions(tiers=(LocalTier(),))) as m:
        m.save(1, args=ocp.args.StandardSave({"a": np.arange(4)}))
    with open(os.path.join(d, "1", layout.manifest_name(0, 1)), "w") as f:
        f.write('{"format": "resilient_ckpt", "ver')
    p = run("ls", d)
    assert_clean(p.stdout)
    assert_clean(p.stderr)
    assert "\\x1b" in p.stdout
    assert "ignoring the manifest" in p.stderr and "\\x1b" in p.stderr, p.stderr
