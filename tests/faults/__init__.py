"""Faults across the package: SIGKILL at every phase of a save, damaged and
hostile files, full disks, two writers, GCS faults, a state machine of
crashes. bench/reliability.py runs these files as its campaign."""
