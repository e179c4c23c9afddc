"""Tests of resilient_ckpt.storage (docs/architecture.md)."""
