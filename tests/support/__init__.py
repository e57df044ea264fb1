"""Helpers shared by several test suites (nothing here is collected as tests)."""
