"""``omnilearn.tf.setup()`` (this module is ``api``: a module named ``setup`` would shadow the function): join the ``TF_CONFIG`` cluster, resolve the batch, open a :class:`~omnilearn.tf.session.TFSession`.

The keywords are the PyTorch ``omnilearn.setup()``'s (:mod:`omnilearn.keywords`):
``global_batch=B`` or ``local_batch=b`` (``B = b x workers``), ``speeds``,
``controller``, ``out``... Mistakes raise :class:`~omnilearn.config.ConfigError`,
one line naming the keyword.

Run: ``python -m pytest -q tests/tf``
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omnilearn import stopping
from omnilearn.config import BalanceConfig, ConfigError, api_wording, dump_toml
from omnilearn.keywords import KEYWORDS, check_keywords, for_world, launched
from omnilearn.observe.rundir import prepare
from omnilearn.tf.cluster import from_env, make_strategy
from omnilearn.tf.session import TFSession, check_supported


def setup(config: BalanceConfig | None = None, *, total_steps: int | None = None, local_batch: int | None = None,
          handle_signals: bool = True, **settings: Any) -> TFSession:
    """Join the cluster of ``TF_CONFIG`` (none: one worker) and start balancing; see :mod:`omnilearn.tf.session`.

    ``handle_signals``: SIGTERM (and SIGINT with peers) set ``should_stop`` on every worker after the same step,
    as in ``omnilearn.setup()`` (:func:`omnilearn.stopping.handle_for_run`).
    """
    try:
        settings = launched(settings)  # --speeds/--out of ``omnilearn launch`` (omnilearn.experiments.userlaunch)
        check_keywords("omnilearn.tf.setup()", settings, local_batch, handle_signals)
        first = dataclasses.replace(config, **settings) if config is not None else BalanceConfig(**settings)
        check_supported(first)
        cluster = from_env()  # the world size, from TF_CONFIG alone: settings are checked before TensorFlow starts
        cfg = for_world(config, settings, local_batch, cluster.world_size, "TF_CONFIG's cluster",
                        "list {n} workers in TF_CONFIG")
    except ConfigError as e:
        raise ConfigError(api_wording(str(e), KEYWORDS)) from None
    strategy = make_strategy(cluster, cfg.timeout_s)
    run_dir = prepare(cfg.out, cfg.overwrite, dump_toml(cfg)) if cfg.out is not None and cluster.is_main else None
    session = TFSession(cfg, cluster, strategy, run_dir, total_steps)
    if handle_signals:
        stopping.handle_for_run(cluster.world_size, cluster.is_main, "omnilearn.tf.setup()")
    return session
