"""Building sharded models: zero-init from a config, streaming loads of pretrained weights."""

from .construct import copy_sharded, zero_init
from .pretrained import from_pretrained, load_weights

__all__ = ["copy_sharded", "from_pretrained", "load_weights", "zero_init"]
