"""experiments.report."""
