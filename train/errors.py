"""User errors: mistakes in the command line, the config or the input data, as opposed to bugs.

``train/run.py`` prints a :class:`UserError` as ONE line (the message names the fix) and exits with
status 1; anything else is a bug and keeps its traceback. ``SPECHEADS_DEBUG=1`` (or ``+debug=true``)
shows the traceback of user errors too. The stages' own error classes derive from :class:`UserError`
(``DataError``, ``ExtractError``, ``ExportError``, ``PublishError``, ``MemoryShortError``), as do
:class:`MissingStageError`, raised when an upstream stage has not run, and :class:`TargetError`.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix; the message says how."""


class ConfigError(UserError, ValueError):
    """A config key with a value it cannot take (train/checks.py)."""


class MissingStageError(UserError, FileNotFoundError):
    """An upstream stage has no complete output in the run directory (train.stages.require)."""


class TargetError(UserError, OSError):
    """The target (or its tokenizer) cannot be loaded: not in the cache offline, a gated model without access, a
    wrong model.path (train.target); an OSError still, as ``from_pretrained`` raises."""
