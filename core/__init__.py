"""Torch-free vocabulary every package shares (gateway, services, runtime, CLI): the speculative-algorithm registry
(`algorithms.py`) and the types that cross the services' wire (`types.py`)."""
