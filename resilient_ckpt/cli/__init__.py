"""The operator's tool, resilient-ckpt: survey of a directory, cleanup, export to
and import from Orbax's format."""
