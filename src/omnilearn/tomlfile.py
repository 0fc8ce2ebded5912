"""Reading the user's TOML files (config, speed schedule) with one-line errors."""

from __future__ import annotations

import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def read_toml(path: str, what: str, error: type[Exception]) -> dict[str, Any]:
    """Parse ``path``; any failure raises ``error`` with a message naming the file."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise error(f"cannot read {what} {path!r}: {e.strerror}; check the path") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise error(f"{what} {path!r} is not valid TOML: {e}") from None


def loads(text: str) -> dict[str, Any]:
    return tomllib.loads(text)
