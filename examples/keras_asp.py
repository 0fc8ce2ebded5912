"""TensorFlow's parameter-server training, asynchronous, on OmniLearn: each worker's batch sized to its speed.

The shape of TensorFlow's "Parameter server training with ParameterServerStrategy"
tutorial: a cluster of a parameter server and workers, a ``ParameterServerStrategy``
over it, the Keras model and optimizer built in its scope. The tutorial's
``ClusterCoordinator`` loop (equal batches, scheduled on whichever worker is
free) is OmniLearn's chief instead: it sizes each worker's batch so that all
push at the same rate, applies every gradient on the parameter server (its
rate scaled by the batch), counts each push's staleness and deals every
sample once per epoch. Three workers on this machine, worker 2 emulated three
times slower::

    python examples/keras_asp.py --workers 3 --speeds 3,3,1 --out runs/keras-asp

``local_cluster`` starts the parameter server and the workers as processes
here. On several machines, start ``python -m omnilearn.tf.servers SPEC JOB
INDEX`` for every task (the same SPEC, JSON of the cluster's ``worker`` and
``ps`` addresses) and build the strategy over that SPEC instead (tested on one
machine only). The data is a toy task (no download): 20 features, the label
the largest of 8 random projections. The run directory gets
``metrics.jsonl`` (every push: its worker, batch, staleness), ``summary.json``
(staleness p50/p99/max per worker) and ``model.weights.h5``. Needs
``pip install 'omnilearn-hetero[tensorflow]'``.

OmniLearn lines: 7

Tested by: ``python -m pytest -q tests/examples/test_keras_asp.py``
"""

import argparse

import keras
import numpy as np
import tensorflow as tf

from omnilearn.config import BalanceConfig  # OmniLearn
from omnilearn.tf.asp import Chief  # OmniLearn
from omnilearn.tf.servers import local_cluster  # OmniLearn

parser = argparse.ArgumentParser()
parser.add_argument("--workers", type=int, default=3)
parser.add_argument("--speeds", default=None, help="relative worker speeds, e.g. 3,3,1 (emulated)")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--global-batch", type=int, default=192, help="samples per step over all workers")
parser.add_argument("--out", default=None, help="run directory")
args = parser.parse_args()

rng = np.random.default_rng(0)
teacher = rng.normal(size=(20, 8))


def toy_dataset(size):
    x = rng.normal(size=(size, 20)).astype(np.float32)
    return x, np.argmax(x @ teacher, axis=1).astype(np.int32)


x_train, y_train = toy_dataset(4096)
x_val, y_val = toy_dataset(1024)


def build_model():
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(8)])


def loss(y, logits):
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def evaluate(model):
    logits = np.asarray(model(x_val, training=False))
    return float(np.mean(loss(y_val, logits))), float(np.mean(np.argmax(logits, axis=1) == y_val))


with local_cluster(args.workers) as spec:  # OmniLearn
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(spec), rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    cfg = BalanceConfig(workers=args.workers, global_batch=args.global_batch, speeds=args.speeds,  # OmniLearn
                        out=args.out, overwrite=True)
    chief = Chief(strategy, cfg, build_model, loss, lambda: keras.optimizers.SGD(learning_rate=0.1),  # OmniLearn
                  x_train, y_train, args.epochs, evaluate=evaluate)
    summary = chief.run()  # OmniLearn
    loss_now, accuracy = evaluate(chief.model)
print(f"validation accuracy {accuracy:.1%}; batches at the end {summary['batches']}")
