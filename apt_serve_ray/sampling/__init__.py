"""Sampling: parameters, the sampler, structured output."""
