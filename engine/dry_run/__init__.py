"""The deviceless path: abstract (weightless) models and inputs, the static step-time
estimate, and the dry run's compile and per-chip fit check (fit)."""
