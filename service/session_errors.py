"""What a session's calls raise; ``rpc.calls`` maps each to its gRPC status."""

from __future__ import annotations


class SessionError(LookupError):
    """The session does not exist (never opened, closed, or lapsed)."""


class OwnershipError(PermissionError):
    """A slot named in a call is not held by the calling session in the needed way."""


class SessionLimit(RuntimeError):
    """Too many sessions are open."""


class CallCancelled(RuntimeError):
    """The client cancelled this call before it ran."""
