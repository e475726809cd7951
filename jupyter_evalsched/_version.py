"""The package's version, in a module of its own: the server modules read it without importing
the package root (whose entry points import them)."""

__version__ = "0.1.0"
