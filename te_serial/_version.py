"""The package version, in a module of its own so every part of te-serial can import it."""

__version__ = "0.1.0"
