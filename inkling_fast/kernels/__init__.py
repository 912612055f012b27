"""One Triton kernel per module, each with its plain-torch twin and a validating wrapper."""
