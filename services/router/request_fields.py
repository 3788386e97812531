"""Request fields the API does not know: noticed, logged once per name, listed back or refused.

vLLM ignores an unknown field and logs "The following fields were present in the request but
ignored" (the client sees nothing); a misspelt or newer parameter then silently changes nothing.
Here the request models note the unknown top-level names (`note_unknown_fields`, a pydantic wrap
validator), and the router's `UnknownFields` policy either refuses them (`strict_fields`: a 400
naming them, OpenAI's own "Unrecognized request argument supplied") or lets the request through
and lists them in the response's `X-Ignored-Fields` header (a PhaseMesh extension: vLLM has no
such header). Each name is logged once per router, at warning level; the set of names logged is
bounded, so a client inventing names cannot grow the router's memory or flood its log.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

import structlog
from pydantic import BaseModel

from services.router.api_errors import APIError

log = structlog.get_logger(__name__)

IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
MAX_LOGGED_NAMES = 1024  # distinct names logged per router; later ones are not logged
MAX_LISTED = 32  # names listed in one header or error (the count says how many more)
MAX_NAME_CHARS = 64
_HEADER_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


@functools.cache
def known_names(model: type[BaseModel]) -> frozenset[str]:
    """The top-level keys a request model reads: its fields' names and aliases."""
    names = set(model.model_fields)
    names.update(f.alias for f in model.model_fields.values() if f.alias)
    return frozenset(names)


def unknown_names(model: type[BaseModel], data: Any) -> tuple[str, ...]:
    """The top-level keys of a request body that `model` does not read, sorted."""
    if not isinstance(data, dict):
        return ()
    known = known_names(model)
    return tuple(sorted(str(k) for k in data if k not in known))


def shown(names: Iterable[str]) -> str:
    """Names for a header or an error message: printable ASCII, each cut short, at most
    `MAX_LISTED` of them (then how many more)."""
    names = list(names)
    listed = [_HEADER_SAFE.sub("?", n[:MAX_NAME_CHARS]) for n in names[:MAX_LISTED]]
    more = len(names) - len(listed)
    return ", ".join(listed) + (f" (and {more} more)" if more else "")


class UnknownFields:
    """The router's policy for unknown request fields; one per router (the names it has logged)."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._logged: set[str] = set()

    def check(self, names: tuple[str, ...], endpoint: str) -> dict[str, str]:
        """Log the names not logged yet; with `strict`, a 400 naming them. Returns the response
        headers that list them (none when there are none)."""
        if not names:
            return {}
        new = [n for n in names if n not in self._logged]
        if new and len(self._logged) < MAX_LOGGED_NAMES:
            self._logged.update(new[: MAX_LOGGED_NAMES - len(self._logged)])
            log.warning(
                "request fields ignored" if not self.strict else "request fields refused",
                fields=shown(new), endpoint=endpoint, strict=self.strict,
            )  # fmt: skip
        if self.strict:
            raise APIError(400, f"Unrecognized request argument supplied: {shown(names)}",
                           _HEADER_SAFE.sub("?", names[0][:MAX_NAME_CHARS]))  # fmt: skip
        return {IGNORED_FIELDS_HEADER: shown(names)}
