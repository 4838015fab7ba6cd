"""Fixtures of the hardening tests, borrowed: the operations tests' tiny model with the bundled tokenizer (and its
perturbed draft), the gateway tests' tiny tokenizer."""
from tests.gateway.conftest import tokenizer, tokenizer_dir  # noqa: F401  (pytest fixtures)
from tests.ops.conftest import tiny_draft, tiny_model  # noqa: F401  (pytest fixtures)
