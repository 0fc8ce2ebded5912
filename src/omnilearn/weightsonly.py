"""What ``torch.load(weights_only=True)`` reads back: a state checked before it is saved, a failed load explained.

Checkpoints are loaded with ``weights_only=True`` (no code runs at load).
That unpickler accepts tensors and plain values only, so a state holding a
numpy scalar, a ``pathlib.Path`` or an object of the user's saves fine and
then never loads. Two helpers keep that from costing a run:

- :func:`first_refused` walks a state before it is written and names the
  first field whose type the unpickler would refuse (``extra['best']:
  numpy.float64``). Exact types, not ``isinstance``: ``numpy.float64`` is a
  ``float`` subclass and is refused. What it accepts is a subset of what
  ``weights_only`` reads (``tests/unit/test_checkpoint.py`` loads a sample of
  each), plus the types registered with ``torch.serialization.add_safe_globals``.
  A walk, not a trial load: it costs no I/O and no second copy of the
  checkpoint in memory, and it can name the field (a failed load only names
  the type).
- :func:`refused_field` finds, in the bytes of a saved file that failed to
  load (one written before these checks, or by another program), the field
  that holds a refused global, by reading its pickle with stand-ins for every
  global: nothing in the file is imported or called.

Run: ``python -m pytest -q tests/unit/test_checkpoint.py``
"""

from __future__ import annotations

import collections
import io
import pickle
import re
import zipfile
from typing import Any, Iterator

import torch

# Types whose values the weights_only unpickler rebuilds (exact types). Containers are walked into.
LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.Tensor, torch.nn.Parameter,
          torch.dtype, torch.device, torch.layout, torch.Size)
CONTAINERS = (dict, collections.OrderedDict, collections.Counter, list, tuple, set)
FIX = ("store plain values (int(), float(), str(), .tolist()) or tensors, or register the type with "
       "torch.serialization.add_safe_globals")


def _type_name(obj: Any) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _children(obj: Any, path: str) -> Iterator[tuple[Any, str]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield key, f"key {key!r} of {path or 'the state'}"
            yield value, f"{path}[{key!r}]" if path else str(key)
    else:
        for i, value in enumerate(obj):
            yield value, f"{path}[{i}]"


def first_refused(state: Any) -> str | None:
    """``"<field path>: <type>"`` of the first value ``weights_only`` would refuse, or None when all load."""
    registered = (g[0] if isinstance(g, tuple) else g for g in torch.serialization.get_safe_globals())
    safe = tuple(g for g in registered if isinstance(g, type))
    stack, seen = [(state, "")], set()
    while stack:
        obj, path = stack.pop()
        kind = type(obj)
        if kind in LEAVES or kind in safe:
            continue
        if kind not in CONTAINERS:
            return f"{path or 'the state'}: {_type_name(obj)}"
        if id(obj) not in seen:
            seen.add(id(obj))
            stack.extend(reversed(list(_children(obj, path))))
    return None


def refused_global(message: str) -> str | None:
    """The global named in a ``weights_only`` unpickling error (``numpy._core.multiarray.scalar``), or None."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", message)
    return found.group(1) if found else None


class _Stand(dict):
    """What a global becomes when a refused file is read for its field: it records, never runs anything."""

    name = ""

    def __new__(cls, *args: Any, **kwargs: Any):
        stand = super().__new__(cls)
        stand.args, stand.appended, stand.state = args, [], None
        return stand

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, value: Any) -> None:
        self.appended.append(value)

    def extend(self, values) -> None:
        self.appended.extend(values)


class _Reader(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        full = name if module in ("builtins", "__builtin__") else f"{module}.{name}"  # protocol 2: __builtin__
        return type(name, (_Stand,), {"name": full})

    def persistent_load(self, pid: Any) -> None:  # a tensor's storage: not needed to find a field
        return None


def _stand_children(obj: Any, path: str) -> Iterator[tuple[Any, str]]:
    if isinstance(obj, _Stand):
        yield from ((v, f"{path}[{i}]") for i, v in enumerate(obj.appended))
        yield from ((v, path) for v in (*obj.args, obj.state))
    if isinstance(obj, (dict, list, tuple, set)):
        yield from _children(obj, path)


def refused_field(data: bytes | bytearray | memoryview, name: str) -> str | None:
    """The path of the first field of a ``torch.save`` file built by global ``name``, or None."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            pkl = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            tree = _Reader(io.BytesIO(archive.read(pkl))).load()
    except Exception:  # noqa: BLE001 - only an explanation is lost
        return None
    stack, seen = [(tree, "")], set()
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, _Stand) and obj.name == name:
            return path or "the state"
        if isinstance(obj, (_Stand, dict, list, tuple, set)) and id(obj) not in seen:
            seen.add(id(obj))
            stack.extend(reversed(list(_stand_children(obj, path))))
    return None
