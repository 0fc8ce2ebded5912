"""Starting and watching worker processes: ``omnilearn train``'s local launcher (PyTorch, TensorFlow) and ``omnilearn launch`` (your own script)."""
