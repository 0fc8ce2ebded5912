"""The keywords of ``setup()``, resolved against the world size: shared by the PyTorch and TensorFlow setups. Pure.

The world size is known only after joining (a process group, a
``tf.distribute`` cluster), so the batch may be given per worker
(``local_batch``) as well as in total (``global_batch``): :func:`check_keywords`
before joining, :func:`for_world` after. ``total_steps``, ``local_batch`` and
``handle_signals`` are keywords of ``setup()`` itself (:data:`SETUP_ONLY`), not
config fields.

Run: ``python -m pytest -q tests/unit/test_api_errors.py tests/faults/test_api_stops.py``
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from omnilearn.config import BalanceConfig, ConfigError
from omnilearn.emulation.speeds import speed_count

DEFAULT_LOCAL_BATCH = 32  # samples per worker per step when neither global_batch nor local_batch is given
SETUP_ONLY = frozenset({"total_steps", "local_batch", "handle_signals"})  # setup()'s own keywords, not config fields
KEYWORDS = frozenset(f.name for f in dataclasses.fields(BalanceConfig)) | SETUP_ONLY
LAUNCH_ENV = "OMNILEARN_LAUNCH"  # the settings ``omnilearn launch`` gives every worker of a user's script (JSON)
LAUNCHED = ("speeds", "out", "timeout_s", "checkpoint_every", "keep_checkpoints", "resume")  # the settings it may give


def launched(settings: dict[str, Any], environ=os.environ) -> dict[str, Any]:
    """``settings`` with what ``omnilearn launch`` gave (:data:`LAUNCH_ENV`) for the keywords the script left out.

    A script that gives one of them itself with another value is a :class:`ConfigError` naming both: the launcher's
    ``--speeds``/``--out``/``--checkpoint-every``... and the script's keyword must agree (or drop one). ``resume``
    is the launcher's alone (a restart after a failure sets it): the script's own is overridden.
    """
    given = json.loads(environ.get(LAUNCH_ENV) or "{}")
    out = dict(settings)
    for name in LAUNCHED:
        if name not in given:
            continue
        if name != "resume" and settings.get(name) is not None and settings[name] != given[name]:
            raise ConfigError(f"{name}={settings[name]!r} in the script, but omnilearn launch --{name.replace('_', '-')} "
                              f"{given[name]}: give it in one place")
        out[name] = given[name]
    return out


def check_keywords(who: str, settings: dict[str, Any], local_batch: int | None, handle_signals: bool = True) -> None:
    """Unknown keywords and a batch given twice or badly, before anything is joined. ``who``: ``omnilearn.setup()``.

    ``settings`` are the config fields; a setup-only keyword among them is one this ``who`` does not take.
    """
    unknown = sorted(set(settings) - KEYWORDS)
    if unknown:
        raise ConfigError(f"{who} got an unknown keyword {unknown[0]}={settings[unknown[0]]!r}; "
                          f"valid ones: {', '.join(sorted(KEYWORDS))}")
    untaken = sorted(set(settings) & SETUP_ONLY)
    if untaken:
        raise ConfigError(f"{who} does not take {untaken[0]}={settings[untaken[0]]!r}; drop it")
    if type(handle_signals) is not bool:
        raise ConfigError(f"handle_signals={handle_signals!r} must be True or False (False: SIGTERM/SIGINT keep "
                          "their own handlers and never set should_stop)")
    if local_batch is not None and "global_batch" in settings:
        raise ConfigError(f"global_batch={settings['global_batch']} and local_batch={local_batch} both given; "
                          "give one (global_batch = local_batch x workers)")
    if local_batch is not None and (type(local_batch) is not int or local_batch < 1):
        raise ConfigError(f"local_batch={local_batch!r} must be a positive integer (samples per worker per step)")


def for_world(config: BalanceConfig | None, settings: dict[str, Any], local_batch: int | None, world: int,
              group: str = "the process group", launch_hint: str = "torchrun --nproc-per-node {n} starts {n}"
              ) -> BalanceConfig:
    """The config for ``world`` workers: ``workers`` and ``speeds`` checked, the batch per worker multiplied out.

    ``group`` names what was joined, ``launch_hint`` how to start ``{n}`` workers (in the errors).
    """
    derived_min = "min_batch" not in settings and (config is None or config.workers is None)
    cfg = dataclasses.replace(config, **settings) if config is not None else BalanceConfig(**settings)
    if cfg.workers is not None and cfg.workers != world:
        raise ConfigError(f"workers={cfg.workers} but {group} has {world}; drop workers")
    said = speed_count(cfg.speeds)
    if said is not None and said != world:
        raise ConfigError(f"speeds={cfg.speeds!r} give {said} workers but {group} has {world} "
                          f"({launch_hint.format(n=said)}); give one speed per worker")
    if local_batch is None and config is None and "global_batch" not in settings:
        local_batch = DEFAULT_LOCAL_BATCH
    per_worker: dict[str, Any] = {} if local_batch is None else {"global_batch": local_batch * world}
    if derived_min:
        per_worker["min_batch"] = None  # derived from the batch per worker, now that the world size is known
    try:
        return dataclasses.replace(cfg, workers=world, **per_worker)
    except ConfigError as e:
        why = f"local_batch={local_batch} x {world} workers: {e}" if local_batch is not None else str(e)
        raise ConfigError(why) from None
