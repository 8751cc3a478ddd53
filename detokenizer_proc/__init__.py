"""The detokenizer process: token ids from the scheduler in, text deltas to the tokenizer out.

All logic lives in `state.py`; this module only wires sockets to `DetokenizerManager`.
"""

from __future__ import annotations

import logging

from ipc.channel import Receiver, Sender
from ipc.config import ServerConfig
from ipc.messages.to_detokenizer import BatchTokens, DetokenizerMessage, StatsReply
from ipc.process import setup_child

from detokenizer_proc.state import DetokenizerManager

__all__ = ["DetokenizerManager", "run_detokenizer"]

logger = logging.getLogger(__name__)


def run_detokenizer(config: ServerConfig) -> None:
    """Process entry: load the tokenizer, report ready, then serve until killed."""
    reporter = setup_child(config, "detokenizer")
    reporter.progress(f"loading tokenizer from {config.model_path}")
    from transformers import AutoTokenizer  # heavy import, only in this process

    tokenizer = AutoTokenizer.from_pretrained(config.model_path,
                                              trust_remote_code=config.trust_remote_code)
    manager = DetokenizerManager(tokenizer)
    inbox: Receiver[DetokenizerMessage] = Receiver(config.detokenizer_endpoint,
                                                   DetokenizerMessage)
    outbox = Sender(config.tokenizer_endpoint)
    logger.info("detokenizing with %s", type(tokenizer).__name__)
    reporter.ready(type(tokenizer).__name__)
    _serve(manager, inbox, outbox)


def _serve(manager: DetokenizerManager, inbox: Receiver[DetokenizerMessage],
           outbox: Sender) -> None:
    # NOTE: runs until the launcher stops us: STOP_SIGNAL's default action is the shutdown.
    while True:
        message = inbox.recv()
        if isinstance(message, BatchTokens):
            outbox.send(manager.process(message))
        elif isinstance(message, StatsReply):
            outbox.send(message)
        # None: a frame that did not decode, already logged by the receiver.
