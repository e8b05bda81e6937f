"""Dramatiq's own test suite run against kumiko's broker (``python -m tests.compat.run``)."""
