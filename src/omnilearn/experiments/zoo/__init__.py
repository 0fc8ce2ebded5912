"""experiments.zoo."""
