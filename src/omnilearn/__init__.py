"""OmniLearn: heterogeneity-aware data-parallel training on PyTorch.

Each worker gets a mini-batch sized to its measured speed, re-tuned at runtime
by a feedback controller, so fast and slow workers finish their steps together.
Run ``omnilearn train`` for the embedded demo; in your own loop::

    import omnilearn
    ol = omnilearn.setup(global_batch=256)
    model, loader = ol.wrap_model(model), ol.data_loader(dataset)
    ...                       # your loop; ol.step(loss) after optimizer.step()
    ol.finish()

See :mod:`omnilearn.bsp.session` and README.md.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["BalanceConfig", "Session", "setup"]


def __getattr__(name: str):  # lazy: ``import omnilearn`` stays cheap for the CLI and the pure modules
    if name in ("setup", "Session"):
        from omnilearn.bsp import session

        return getattr(session, name)
    if name == "BalanceConfig":
        from omnilearn.config import BalanceConfig

        return BalanceConfig
    raise AttributeError(f"module 'omnilearn' has no attribute {name!r}")
