"""The error a bad config value raises, at the bottom of the package so that every layer that checks
a key (``config.py``, ``placement.py``, the pre-flight) raises the same class without importing
the config module. Imports nothing of the package.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config key has a bad value; the message names the key, the value and the fix."""
