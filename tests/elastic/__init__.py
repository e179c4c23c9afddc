"""Tests of resilient_ckpt.elastic (docs/architecture.md)."""
