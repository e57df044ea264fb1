"""Contracts shared by every hpcrl service (see ../../../../shared/DESIGN.md)."""

__version__ = "0.1.0"
