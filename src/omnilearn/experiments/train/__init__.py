"""``omnilearn train``: the training job (BSP and ASP, PyTorch and TensorFlow workers), its checks, restarts and fault injection."""
