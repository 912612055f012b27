"""inkling_ref: a readable reference of the Inkling model and its multi-depth MTP speculative decoding."""

from . import speculative  # the cycle: prefill, draft, verify, accept_greedy, commit
from .cache import LayerCache, TrunkCache
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import ConfigError, InklingConfig
from .generation import AcceptanceStats, CycleRecord, GenerationResult, generate
from .model import InklingModel
from .random_init import random_model, randomize_
from .sampling import SamplingParams

__all__ = ["AcceptanceStats", "CheckpointError", "ConfigError", "CycleRecord", "GenerationResult",
           "InklingConfig", "InklingModel", "LayerCache", "SamplingParams", "TrunkCache", "generate",
           "load_checkpoint", "random_model", "randomize_", "save_checkpoint", "speculative"]
