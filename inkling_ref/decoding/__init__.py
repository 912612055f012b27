"""Decoding with the MTP head:

    speculative.py  the cycle as explicit steps on one sequence: prefill, draft, verify, accept, commit
    generation.py   generate(): batches of prompts, the cycle per sequence, acceptance statistics
    sampling.py     temperature / top-k / top-p and rejection sampling, written on explicit uniforms
"""
