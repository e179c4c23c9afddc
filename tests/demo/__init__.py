"""Tests of resilient_ckpt.demo."""
