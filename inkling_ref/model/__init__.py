"""The Inkling model, one op per file, in reading order:

    norm.py         RMSNorm in float32
    conv.py         the short causal convolution with its internal residual
    attention.py    q/k/v/r projections, per-head norms, relative-logit bias, log-tau, GQA, masks
    mlp.py          the dense SwiGLU MLP (interleaved gate/up rows)
    moe.py          routed + shared experts, sigmoid routing
    block.py        one decoder layer: two residual branches, each through its own short conv
    trunk.py        embedding, the layers, the final norm and the LM head readout
    mtp.py          the MTP head: one depth block per draft position
    model.py        InklingModel: the trunk and the MTP head, with teacher-forced forwards
    cache.py        per-layer KV and conv-input caches addressed by position (plain tensors)
    tree_paths.py   the masks and conv windows of a tree of tokens (tree drafts)
    random_init.py  seeded random weights with every parameter non-trivial
"""
