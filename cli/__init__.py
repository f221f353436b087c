"""The ``zerotune`` command line (installed as ``zerotune.cli``)."""

from .main import main

__all__ = ["main"]
