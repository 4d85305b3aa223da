"""Link shaping (kept for imports): see :mod:`fabric.core.link`."""

from fabric.core.link import LinkShaper

__all__ = ["LinkShaper"]
