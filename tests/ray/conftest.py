"""The Ray door's tests: Ray's settings for a local cluster, in the environment before Ray is imported.

Ray reads some of them when it is imported (the node address: 127.0.0.1, never the machine's interface), and
the processes of a local cluster inherit the rest (:mod:`raycluster` says what each does).

Run: ``python -m pytest -q tests/ray/``
"""

from __future__ import annotations

import os

import raycluster

for _key, _value in raycluster.ENV.items():
    os.environ.setdefault(_key, _value)
