"""The operations fixtures (tiny model with the bundled tokenizer, its perturbed draft) for the hardening tests."""
from tests.ops.conftest import tiny_draft, tiny_model  # noqa: F401  (pytest fixtures)
