"""Start-up reports from the children to the launcher."""

from __future__ import annotations

from ipc.messages.common import Message


class ProcessProgress(Message, frozen=True):
    """A start-up stage worth showing to the user (model loading can take minutes)."""

    name: str
    text: str


class ProcessReady(Message, frozen=True):
    name: str
    detail: str = ""


LauncherMessage = ProcessProgress | ProcessReady
