"""Helpers shared by the tests (not a test module)."""
