"""Helpers the tests share; no tests here.

  tiers      a manager on fresh RAM- and local-tier directories; `flip`, a
             byte flip in a stored file
  saver      the SIGKILL campaign's child (tests/faults/test_kill.py): run as
             a script, imported by the parent for what each step holds
  writer     the second writer of tests/faults/test_two_writers.py: run as a
             script, imported for states and exact checks
  gcs_state  states and checks of the GCS fault tests (tests/faults/)

Import them as `from tests.support import tiers`. The scripts (saver,
writer) import nothing from tests/, so `python tests/support/saver.py ...`
works from any directory.
"""
