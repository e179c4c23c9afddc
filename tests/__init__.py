"""The test suite, laid out as the package is (docs/contributing.md, "Tests").

A package so that test modules with the same name in two folders do not
clash, and so that `from tests.support import ...` works under pytest's
default import mode (pytest puts the repository root on sys.path).
"""
