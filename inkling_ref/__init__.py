"""inkling_ref: a readable reference of the Inkling model and its multi-depth MTP speculative decoding."""

from .cache import LayerCache, TrunkCache
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import ConfigError, InklingConfig
from .model import InklingModel
from .random_init import random_model, randomize_
from . import speculative  # noqa: E402  (the cycle: prefill, draft, verify, accept_greedy, commit)
from .generate import AcceptanceStats, CycleRecord, GenerationResult, generate  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

<<<<<<< HEAD
__all__ = ["ConfigError", "InklingConfig", "InklingModel", "LayerCache", "TrunkCache", "random_model",
           "randomize_", "speculative", "generate", "GenerationResult", "CycleRecord",
           "AcceptanceStats", "SamplingParams"]
=======
__all__ = ["CheckpointError", "ConfigError", "InklingConfig", "InklingModel", "LayerCache", "TrunkCache",
           "load_checkpoint", "random_model", "randomize_", "save_checkpoint"]
>>>>>>> ckpt
