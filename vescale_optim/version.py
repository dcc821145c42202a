"""The package version, importable without importing the package face."""

__version__ = "0.1.0"
