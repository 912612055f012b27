"""inkling_ref: a readable reference of the Inkling model and its multi-depth MTP speculative decoding.

    model/      the model's ops, one per file: norm, conv, attention, mlp, moe, block, trunk, mtp, model,
                and the plain caches they read and write
    decoding/   the speculative cycle (speculative), generate and its statistics (generation), sampling
    tree/       tree drafts: a tree of candidates from the MTP depths, verified in one trunk pass
    io/         config.json (config), checkpoints (checkpoint, names, transformers_layout)
    port_check/ the port checker: a dump of what an engine's depths computed, checked against the
                reference, with the known porting mistake that reproduces it (docs/port_checker.md)
    testing.py  how the project compares tensors
"""

from .decoding import speculative  # the cycle: prefill, draft, verify, accept_greedy, commit
from .decoding.generation import AcceptanceStats, CycleRecord, GenerationResult, generate
from .decoding.sampling import SamplingParams
from .decoding.speculative import NonFiniteError
from .io.checkpoint import DEFAULT_CHECKPOINT, CheckpointError, load_checkpoint, save_checkpoint
from .io.config import ConfigError, InklingConfig
from .model.cache import LayerCache, TrunkCache
from .model.model import InklingModel
from .model.random_init import random_model, randomize_

__all__ = ["AcceptanceStats", "CheckpointError", "ConfigError", "CycleRecord", "DEFAULT_CHECKPOINT",
           "GenerationResult", "InklingConfig", "InklingModel", "LayerCache", "NonFiniteError", "SamplingParams",
           "TrunkCache",
           "generate", "load_checkpoint", "random_model", "randomize_", "save_checkpoint", "speculative"]
