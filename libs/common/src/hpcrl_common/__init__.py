"""Contracts shared by every hpcrl service (see docs/DESIGN.md in the repository)."""

__version__ = "0.1.0"
