"""Torch-free vocabulary every package shares (gateway, services, runtime, CLI): the speculative-algorithm registry."""
