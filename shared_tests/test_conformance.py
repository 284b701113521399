"""The shipped conformance suite, collected from ``ttt.testing``: every test of its test
modules (the same tests that ``pytest --pyargs ttt.testing --ttt-backend NAME`` runs)."""

from ttt.testing import suite_tests

globals().update(suite_tests())
