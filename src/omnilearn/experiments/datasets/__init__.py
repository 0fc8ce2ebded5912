"""experiments.datasets."""
