"""The dry run's abstract models and inputs: ``engine.weights.abstract``'s builders, shared
with ``--overlap_compile`` so that both lay out shapes exactly as placement does."""

from engine.weights.abstract import (  # noqa: F401  (the dry run's names for them)
    abstract_arrays,
    abstract_inputs,
    abstract_transformer,
    abstract_vae,
)
