"""Errors whose message names parameters, so each caller can name its own flags."""

from __future__ import annotations


class NamingError(Exception):
    """An error whose message names parameters; the message is a template with a {} per name.

    str() writes the library's names (`batch_size must be at least 1, got 0`); a command
    line passes its own spelling of each name to `spelled` (`--batch-size must be ...`).
    """

    def __init__(self, params: str | tuple[str, ...], template: str):
        self.params = (params,) if isinstance(params, str) else tuple(params)
        self.template = template
        super().__init__(self.spelled(lambda name: name))

    def spelled(self, spell) -> str:
        """The message with each parameter written as spell(name)."""
        return self.template.format(*map(spell, self.params))


class ParamError(NamingError, ValueError):
    """A bad value of named parameters."""


def check_choice(param: str, value, choices) -> str:
    """value if it is one of choices, else a ParamError that lists them."""
    if value not in choices:
        raise ParamError(param, f"unknown {{}} {value!r}: use one of {', '.join(map(str, choices))}")
    return value
