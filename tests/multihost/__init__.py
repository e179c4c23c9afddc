"""Tests of resilient_ckpt.multihost (docs/architecture.md)."""
