"""Tests of resilient_ckpt.restore (docs/architecture.md)."""
