"""The process and its settings: one-line errors, the frozen RunConfig, chip facts, the
device mesh, and the JAX runtime (platform, compilation cache, multi-host, OOM errors)."""
