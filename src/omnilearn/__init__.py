"""OmniLearn: heterogeneity-aware data-parallel training on PyTorch.

Each worker gets a mini-batch sized to its measured speed, re-tuned at runtime
by a feedback controller, so fast and slow workers finish their steps together.
Run ``omnilearn train`` for the embedded demo; see README.md for the API.
"""

__version__ = "0.1.0"
