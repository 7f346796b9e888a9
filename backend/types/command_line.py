"""The manners every Tandem command line shares (``tandem``, ``python -m backend.server``,
``python -m frontend.server``): ``--help`` shows each option's default, and a bad argument is one
line naming the option, not the whole usage.

Torch-free (stdlib only): the frontend's commands use it too.
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help, unless the help states its default already
    (which is how an option whose default comes from a secret, e.g. ``$TANDEM_API_KEY``, names
    the variable instead of showing its value), or there is none to show: no value (None), an
    on/off switch, a positional argument."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("(default" in text or "%(default)" in text or not action.option_strings
                or action.default is None or action.default is argparse.SUPPRESS
                or isinstance(action.default, bool)):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class CommandLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``prog: error: argument --port: ...``)
    pointing at ``--help``, instead of a usage block that, for ``tandem serve``, runs to dozens of
    lines before the one that matters. Sub-command parsers are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
