"""Portico: a gateway between client apps and AI agents."""

__version__ = "0.1.0"
