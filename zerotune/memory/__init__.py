"""Where shards live and how many bytes each kind takes."""

from .pool import BufferPool

__all__ = ["BufferPool"]
