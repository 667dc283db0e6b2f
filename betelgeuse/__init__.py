"""Betelgeuse: out-of-core Mixture-of-Experts inference from GGUF files."""

__version__ = "0.1.0"
