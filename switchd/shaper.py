"""Link shaping (kept for imports): see :mod:`fabric.link`."""

from fabric.link import LinkShaper

__all__ = ["LinkShaper"]
