"""Orbax's vocabulary in and out: its args objects, its metadata types, its root
metadata file, and the steps Orbax itself wrote in a directory."""
