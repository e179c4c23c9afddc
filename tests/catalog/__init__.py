"""Tests of resilient_ckpt.catalog (docs/architecture.md)."""
