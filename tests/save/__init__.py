"""Tests of resilient_ckpt.save (docs/architecture.md)."""
