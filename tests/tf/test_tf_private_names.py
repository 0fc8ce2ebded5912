"""Every private name (and undocumented behaviour) of TensorFlow and Keras that ``src/omnilearn/tf/`` relies on.

Each test fails loudly, naming what moved, when a release renames, drops or changes the signature of one:
the versions these tests pass on are the versions ``omnilearn.tf.setup()`` accepts (``require_tested``;
tested: tensorflow-cpu 2.21.0, keras 3.15.1). What the door uses, and where:

- ``tf.data``: ``dataset._input_dataset`` and the class names ``_BatchDataset``, ``_PaddedBatchDataset``,
  ``_UnbatchDataset`` (``omnilearn.tf.data.batched_by`` refuses a batched dataset by them);
- Keras ``Model``: ``model._compile_metrics`` (a ``CompileMetrics``: ``update_state(y_true, y_pred,
  sample_weight=None)``, ``build(y_true, y_pred)``, ``built``, ``result``, ``reset_state``, ``variables``) and
  ``model._loss_tracker`` (``omnilearn.tf.reduced`` reduces them across workers);
- Keras' TensorFlow optimizer: ``_all_reduce_sum_gradients(grads_and_vars)``, the one all-reduce of a step's
  gradients, called by ``apply_gradients`` with every (gradient, variable) pair (``omnilearn.tf.steps.
  apply_carrying`` lends it the metrics' table for one trace), and ``gradient_accumulation_steps``;
- Keras, public but load-bearing: ``CallbackList(callbacks, add_history, add_progbar, model, **params)``;
  ``BackupAndRestore``'s ``backup_dir``, ``save_freq``, ``double_checkpoint``, ``delete_checkpoint``;
  ``Optimizer.scale_loss(loss)``; a ``LossScaleOptimizer`` that skips a step of non-finite gradients and
  halves its scale (``omnilearn.tf.steps.agree_finite`` makes every worker see the same finiteness); a Keras 3
  model's variables checkpointed by position (``omnilearn.tf.changed``);
- ``tensorflow.python.eager.context.context().check_alive(device)`` (``omnilearn.tf.asp``: a failed call's
  worker, gone or alive);
- Keras 3's ``fit`` without parameter-server support (no ``ParameterServerStrategy`` or ``ClusterCoordinator``
  in its trainers): why ``omnilearn.tf.setup(mode='asp')`` and ``ol.fit`` refuse asynchronous training.

Run: ``python -m pytest -q tests/tf/test_tf_private_names.py``
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from needs import needs

pytestmark = needs("tensorflow", "tensorflow")


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.fixture(scope="module")
def tf():
    import tensorflow

    return tensorflow


@pytest.fixture(scope="module")
def keras():
    import keras

    return keras


def test_tf_data_pipelines_link_to_their_input_and_name_their_batching(tf):
    examples = tf.data.Dataset.from_tensor_slices((np.zeros((4, 2)), np.zeros(4)))
    for dataset, name in [(examples.batch(2), "_BatchDataset"), (examples.padded_batch(2), "_PaddedBatchDataset"),
                          (examples.batch(2).unbatch(), "_UnbatchDataset")]:
        assert type(dataset).__name__ == name, f"tf.data renamed {name}: omnilearn.tf.data.batched_by reads it"
    prefetched = examples.batch(2).prefetch(1)
    assert type(prefetched._input_dataset).__name__ == "_BatchDataset", "tf.data moved Dataset._input_dataset"


def test_a_compiled_model_keeps_its_metrics_and_loss_tracker(keras):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    compiled, tracker = model._compile_metrics, model._loss_tracker
    assert isinstance(tracker, keras.metrics.Mean)
    assert parameters(type(compiled).update_state) == ["self", "y_true", "y_pred", "sample_weight"]
    assert parameters(type(compiled).build) == ["self", "y_true", "y_pred"] and compiled.built is False
    for name in ("result", "reset_state", "variables"):
        assert hasattr(compiled, name), f"Keras' CompileMetrics lost {name}"
    assert [m.name for m in model.metrics] == ["loss", "compile_metrics"]


def test_keras_callback_list_and_backup_and_restore_keep_what_fit_reads(keras, tmp_path):
    assert parameters(keras.callbacks.CallbackList.__init__) == ["self", "callbacks", "add_history", "add_progbar",
                                                                 "model", "params"]
    backup = keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=5, double_checkpoint=True,
                                              delete_checkpoint=False)
    assert (backup.backup_dir, backup.save_freq, backup.double_checkpoint, backup.delete_checkpoint) == (
        str(tmp_path), 5, True, False)


def test_the_optimizer_all_reduces_the_gradients_in_one_method(keras, tf):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        optimizer, variable = keras.optimizers.SGD(0.5), keras.Variable([1.0])
    assert parameters(type(optimizer)._all_reduce_sum_gradients) == ["self", "grads_and_vars"]
    assert optimizer.gradient_accumulation_steps is None
    seen = []
    optimizer.__dict__["_all_reduce_sum_gradients"] = lambda pairs: seen.append(list(pairs)) or seen[-1]
    strategy.run(tf.function(lambda: optimizer.apply_gradients([(tf.constant([2.0]), variable)])))
    assert len(seen) == 1 and len(seen[0]) == 1, "Keras' apply_gradients no longer calls _all_reduce_sum_gradients"
    assert float(variable.numpy()[0]) == 0.0


def test_optimizers_scale_the_loss_and_a_loss_scale_optimizer_skips_non_finite_steps(keras, tf):
    assert parameters(keras.optimizers.Optimizer.scale_loss) == ["self", "loss"]
    assert parameters(keras.optimizers.LossScaleOptimizer.scale_loss) == ["self", "loss"]
    variable = keras.Variable([1.0])
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=8.0)
    assert float(optimizer.scale_loss(tf.constant(2.0))) == 16.0
    optimizer.apply_gradients([(tf.constant([float("nan")]), variable)])
    assert float(variable.numpy()[0]) == 1.0 and float(optimizer.scale_loss(tf.constant(1.0))) == 4.0
    optimizer.apply_gradients([(tf.constant([4.0]), variable)])  # unscaled by 4: 1 - 0.5 * 1
    assert float(variable.numpy()[0]) == 0.5 and int(optimizer.iterations.numpy()) == 1


def test_a_keras_model_is_checkpointed_by_position(keras, tf, tmp_path):
    """Why ``omnilearn.tf.changed`` compares shapes by position: names are not what a checkpoint matches."""
    def model(name: str):
        return keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, name=name)])

    saved, other = model("first"), model("renamed")
    saved.set_weights([np.ones((2, 3)), np.ones(3)])
    optimizer = keras.optimizers.SGD()
    optimizer.build(saved.trainable_variables)
    tf.train.Checkpoint(model=saved, optimizer=optimizer).write(str(tmp_path / "model"))
    optimizer = keras.optimizers.SGD()
    optimizer.build(other.trainable_variables)
    tf.train.Checkpoint(model=other, optimizer=optimizer).read(str(tmp_path / "model")).assert_consumed()
    assert np.array_equal(other.get_weights()[0], np.ones((2, 3)))


def test_the_eager_context_tells_whether_a_remote_task_is_alive(tf):
    from tensorflow.python.eager import context

    check = getattr(context.context(), "check_alive", None)
    assert callable(check) and parameters(check) == ["worker_name"], \
        "TensorFlow moved context.context().check_alive(worker_name): omnilearn.tf.asp tells a dead worker by it"


def test_keras_fit_still_has_no_parameter_server_support(keras):
    """Why ``ol.fit`` (and ``omnilearn.tf.setup(mode='asp')``) is refused for asynchronous training: Keras 3's
    trainer never mentions ``ParameterServerStrategy`` or a ``ClusterCoordinator`` (Keras 2's ``fit`` scheduled
    its steps on one). When a release adds them, revisit the refusal (``omnilearn.tf.api.refuse_asp``)."""
    from pathlib import Path

    trainers = Path(keras.__file__).parent / "src" / "trainers"
    backend = Path(keras.__file__).parent / "src" / "backend" / "tensorflow"
    sources = sorted([*trainers.rglob("*.py"), *backend.rglob("*.py")])
    assert sources, f"Keras moved its trainers out of {trainers} and {backend}: find fit's source again"
    for path in sources:
        text = path.read_text(errors="replace")
        for name in ("ParameterServerStrategy", "ClusterCoordinator"):
            assert name not in text, f"Keras {keras.__version__} mentions {name} in {path}: its fit may run under " \
                                     "a parameter server now; revisit omnilearn.tf.api.refuse_asp"
