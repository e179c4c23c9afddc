"""Tests of resilient_ckpt.core (docs/architecture.md)."""
