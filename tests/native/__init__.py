"""Tests of resilient_ckpt.native (docs/architecture.md)."""
