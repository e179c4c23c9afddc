"""Tests of resilient_ckpt.cli (docs/architecture.md)."""
