"""OmniLearn: heterogeneity-aware data-parallel training on PyTorch.

Each worker gets a mini-batch sized to its measured speed, re-tuned at runtime
by a feedback controller, so fast and slow workers finish their steps together.
Run ``omnilearn train`` for the embedded demo; in your own loop::

    import omnilearn
    ol = omnilearn.setup(local_batch=64)     # or global_batch=...
    model, loader = ol.wrap_model(model), ol.data_loader(dataset)
    ...                       # your loop; ol.step(loss) after optimizer.step()
    ol.finish()

See :mod:`omnilearn.bsp.session` and README.md.
"""

from __future__ import annotations

from omnilearn.config import BalanceConfig, ConfigError  # torch-free: errors and settings need no torch import

__version__ = "0.1.0"
__all__ = ["BalanceConfig", "ConfigError", "Session", "setup"]


def __getattr__(name: str):  # lazy: ``import omnilearn`` stays cheap for the CLI and the pure modules
    if name == "setup":
        from omnilearn.bsp.setup import setup

        return setup
    if name == "Session":
        from omnilearn.bsp.session import Session

        return Session
    raise AttributeError(f"module 'omnilearn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
