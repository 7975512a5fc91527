"""The suite's user-facing errors: each becomes one clear line and a non-zero exit in the CLI."""

from __future__ import annotations

__all__ = ["DataError", "NotReady", "UserError"]


class UserError(Exception):
    """A problem with what the user asked for or pointed at (bad data path, bad option): one clear line."""


class NotReady(UserError, ValueError):
    """An experiment cannot be planned yet (e.g. an arm's learning rate awaits its sweep): it has no records."""


class DataError(UserError):
    """A dataset could not be found, read or validated; the message says how to fix it."""
