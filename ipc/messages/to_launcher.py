"""Reports from the children to the launcher: start-up progress, readiness, failure."""

from __future__ import annotations

from ipc.messages.common import Message


class ProcessProgress(Message, frozen=True):
    """A start-up stage worth showing to the user (model loading can take minutes)."""

    name: str
    text: str


class ProcessReady(Message, frozen=True):
    name: str
    detail: str = ""


class ProcessFailed(Message, frozen=True):
    """A child's entry function raised; sent just before the child exits, so the launcher
    can say why in its own words. `refusal`: the child refused to serve (an unsupported
    model) and `reason` says it all; otherwise `reason` is the exception's type and text,
    and its traceback is in the child's log."""

    name: str
    reason: str
    refusal: bool = False


LauncherMessage = ProcessProgress | ProcessReady | ProcessFailed
