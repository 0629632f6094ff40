"""The irdma version (one place: the package, the build info metric, dumps)."""

__version__ = "0.1.0"
