"""A ``tf.data.Dataset`` of examples made the arrays OmniLearn's global plan indexes: ``ol.data(dataset)``.

OmniLearn's batches are the PyTorch runtime's (:class:`~omnilearn.data.schedule.GlobalPlan`):
epoch ``e`` permutes ALL samples by ``(seed, e)`` and worker ``i`` takes its
contiguous slice of each step's ``B``. That needs random access to any
sample, which a ``tf.data`` pipeline does not give; so :func:`examples`
reads the dataset once, to its end, into numpy arrays (``x``, ``y``) on
every worker, and the plan indexes them from then on. The cost: the whole
dataset in memory on every worker, and one pass over it at start-up (the
pipeline's ``map``/``interleave``/file reads run once, not once per epoch:
random augmentation in ``map`` is frozen to that pass). An infinite
dataset (``.repeat()`` without a count) is refused, and so is a batched one:
the global batch is OmniLearn's, cut per worker by speed, so the examples
must come unbatched (``.unbatch()``, or take the dataset before ``.batch()``).

Elements are ``(x, y)`` pairs of tensors, one input and one target, as
``ol.data(x, y)`` takes (every example of a component the same shape);
anything else (dicts of inputs, sample weights) is refused naming the
element's structure.

Run: ``python -m pytest -q tests/tf/test_tf_data.py``
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from omnilearn.config import ConfigError

READ_CHUNK = 65_536  # examples read per batch while materialising (the dataset's own batching is refused)


def batched_by(dataset: tf.data.Dataset) -> str | None:
    """The batching transformation a dataset ends with (through ``map``/``prefetch``...), or None.

    Walks the pipeline's chain of inputs from the last transformation back; an ``unbatch()`` after the batch
    undoes it.
    """
    node = dataset
    while node is not None:
        name = type(node).__name__
        if "Unbatch" in name:
            return None
        if "Batch" in name:
            return name.strip("_").removesuffix("Dataset")
        node = getattr(node, "_input_dataset", None)
    return None


def examples(dataset: tf.data.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """Every ``(x, y)`` example of ``dataset``, read once, as two arrays of the same length (see the module)."""
    if not isinstance(dataset, tf.data.Dataset):
        raise ConfigError(f"data({type(dataset).__name__}): give a tf.data.Dataset of (x, y) examples, or arrays x, y")
    batch = batched_by(dataset)
    if batch is not None:
        raise ConfigError(f"data(dataset): the dataset is batched ({batch}); OmniLearn cuts each global batch per "
                          "worker itself: pass it unbatched (add .unbatch(), or take it before .batch())")
    if int(dataset.cardinality()) == tf.data.INFINITE_CARDINALITY:
        raise ConfigError("data(dataset): the dataset is infinite (.repeat() without a count); pass one pass over "
                          "the examples: epochs repeat it")
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2 and all(isinstance(s, tf.TensorSpec) for s in spec)):
        raise ConfigError(f"data(dataset): elements must be (x, y) pairs of tensors, not {spec}; map them to "
                          "(x, y) first")
    xs, ys = [], []
    for x, y in dataset.batch(READ_CHUNK).as_numpy_iterator():
        xs.append(x)
        ys.append(y)
    if not xs:
        raise ConfigError("data(dataset): the dataset is empty; give it the training examples")
    return np.concatenate(xs), np.concatenate(ys)
