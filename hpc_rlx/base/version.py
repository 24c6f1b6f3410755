"""The package version, written into checkpoints and prepared data files."""

__version__ = "0.1.0"
