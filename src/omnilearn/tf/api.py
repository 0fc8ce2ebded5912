"""``omnilearn.tf.setup()`` (this module is ``api``: a module named ``setup`` would shadow the function): join the ``TF_CONFIG`` cluster, resolve the batch, open a :class:`~omnilearn.tf.session.TFSession`.

The keywords are the PyTorch ``omnilearn.setup()``'s (:mod:`omnilearn.keywords`):
``global_batch=B`` or ``local_batch=b`` (``B = b x workers``), ``speeds``,
``controller``, ``out``... Mistakes raise :class:`~omnilearn.config.ConfigError`,
one line naming the keyword.

Run: ``python -m pytest -q tests/tf``
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from omnilearn import stopping
from omnilearn.config import BalanceConfig, ConfigError, api_wording, dump_toml
from omnilearn.keywords import KEYWORDS, check_keywords, for_world, launched
from omnilearn.observe.rundir import prepare
from omnilearn.tf.cluster import from_env, make_strategy
from omnilearn.tf.session import TFSession, check_supported
from omnilearn.versions import installed, require_tested

DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "keras")  # whichever TensorFlow is installed, and Keras


def setup(config: BalanceConfig | None = None, *, total_steps: int | None = None, local_batch: int | None = None,
          handle_signals: bool = True, **settings: Any) -> TFSession:
    """Join the cluster of ``TF_CONFIG`` (none: one worker) and start balancing; see :mod:`omnilearn.tf.session`.

    ``handle_signals``: SIGTERM (and SIGINT with peers) set ``should_stop`` on every worker after the same step,
    as in ``omnilearn.setup()`` (:func:`omnilearn.stopping.handle_for_run`).
    ``checkpoint_every=N`` (steps; needs ``out``), ``keep_checkpoints=K``, ``resume=True``: checkpoints in
    ``out/checkpoints``, and the newest loaded before training (:meth:`TFSession.checkpoint_to`); ``omnilearn
    launch`` gives them from its flags.
    """
    check_versions()
    try:
        settings = launched(settings)  # the flags of ``omnilearn launch`` (omnilearn.experiments.launch.script)
        refuse_asp(settings.pop("mode", "bsp"))
        every, keep = settings.pop("checkpoint_every", 0), settings.pop("keep_checkpoints", 3)
        resume = settings.pop("resume", False)
        check_keywords("omnilearn.tf.setup()", settings, local_batch, handle_signals)
        check_checkpointing(settings.get("out") or getattr(config, "out", None), every, resume)
        first = dataclasses.replace(config, **settings) if config is not None else BalanceConfig(**settings)
        check_supported(first)
        cluster = from_env()  # the world size, from TF_CONFIG alone: settings are checked before TensorFlow starts
        cfg = for_world(config, settings, local_batch, cluster.world_size, "TF_CONFIG's cluster",
                        "list {n} workers in TF_CONFIG")
    except ConfigError as e:
        raise ConfigError(api_wording(str(e), KEYWORDS)) from None
    strategy = make_strategy(cluster, cfg.timeout_s)
    run_dir = None
    if cfg.out is not None and cluster.is_main:
        run_dir = Path(cfg.out) if resume else prepare(cfg.out, cfg.overwrite, dump_toml(cfg))
    session = TFSession(cfg, cluster, strategy, run_dir, total_steps)
    if every or resume:
        session.checkpoint_to(Path(cfg.out) / "checkpoints", every, keep, resume)
    if handle_signals:
        stopping.handle_for_run(cluster.world_size, cluster.is_main, "omnilearn.tf.setup()")
    return session


def refuse_asp(mode: Any) -> None:
    """``mode="asp"``: one line naming the asynchronous route (``setup`` is synchronous; Keras 3's ``fit`` has no
    parameter-server support, so ``ol.fit`` cannot run asynchronously: docs/tensorflow.md)."""
    if mode == "bsp":
        return
    if mode == "asp":
        raise ConfigError("omnilearn.tf.setup(mode='asp'): setup() and ol.fit train synchronously (Keras 3's fit has "
                          "no ParameterServerStrategy support); train asynchronously with omnilearn.tf.asp.Chief on a "
                          "ParameterServerStrategy, or omnilearn train --framework tensorflow --mode asp")
    raise ConfigError(f"omnilearn.tf.setup(mode={mode!r}): mode is 'bsp' (the default); asynchronous training is "
                      "omnilearn.tf.asp.Chief")


def check_versions() -> None:
    """Refuse a TensorFlow or Keras outside the tested versions (the door reads private names of both:
    ``tests/tf/test_tf_private_names.py``); see :mod:`omnilearn.versions`."""
    for dist in DISTRIBUTIONS:
        if installed(dist) is not None:
            require_tested(dist, door="omnilearn.tf")


def check_checkpointing(out: str | None, every: Any, resume: Any) -> None:
    """``checkpoint_every``/``resume`` need ``out`` (the run directory); ``resume`` one that holds a run."""
    if type(resume) is not bool:
        raise ConfigError(f"resume={resume!r} must be True or False")
    if (every or resume) and out is None:
        raise ConfigError(f"{'resume=True' if resume else f'checkpoint_every={every}'} needs out=: the run directory "
                          "that holds the checkpoints")
    if resume and not (Path(out) / "config.toml").is_file():
        raise ConfigError(f"resume=True: out={str(out)!r} holds no run (no config.toml); check out=, or start a new "
                          "run without resume")
