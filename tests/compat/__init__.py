"""Parity with Orbax (resilient_ckpt.compat and the manager's Orbax face):
the same calls on Orbax's classes and on ours."""
