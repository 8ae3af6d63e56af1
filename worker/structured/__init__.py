"""Structured outputs: grammars compiled by llguidance, token bitmasks for the sampler."""
