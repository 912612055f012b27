"""inkling_ref: a readable reference of the Inkling model and its multi-depth MTP speculative decoding."""

from .cache import LayerCache, TrunkCache
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import ConfigError, InklingConfig
from .model import InklingModel
from .random_init import random_model, randomize_

__all__ = ["CheckpointError", "ConfigError", "InklingConfig", "InklingModel", "LayerCache", "TrunkCache",
           "load_checkpoint", "random_model", "randomize_", "save_checkpoint"]
