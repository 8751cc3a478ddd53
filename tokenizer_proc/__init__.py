"""The front process: HTTP (OpenAI API) and ZMQ clients in, tokenized requests out.

Layout: `protocol` (request bodies), `prepare` (validation, chat template, tokenization),
`manager` (request ids, output routing, aborts, stats), `metrics` (Prometheus series,
request and throughput logs), `responses` (OpenAI and native shapes), `http_api` (FastAPI
routes), `security` (API key, body size cap), `client_front` (ZMQ clients), `server`
(sockets, uvicorn, signals), `remote_code` (the launcher's trust_remote_code check),
`constraints` (structured output's grammars), `background` (values built ahead of need).
"""

from __future__ import annotations

import logging
import signal
import sys

from ipc.config import ServerConfig
from ipc.process import STOP_SIGNAL, setup_child

logger = logging.getLogger(__name__)


def run_tokenizer(config: ServerConfig) -> None:
    """Process entry: load the tokenizer, serve until the launcher's stop signal, exit 0."""
    reporter = setup_child(config, "tokenizer")
    # Until the event loop takes the stop signal over, a stop during loading is a clean exit.
    signal.signal(STOP_SIGNAL, lambda signum, frame: sys.exit(0))
    # Imported here so that importing the package (the launcher does) stays cheap.
    import uvloop

    from tokenizer_proc.chat_template import default_template_kwargs, is_inline
    from tokenizer_proc.prepare import RequestPreparer, generation_overrides
    from tokenizer_proc.server import TokenizerServer

    model_path = config.model_path or config.model
    reporter.progress(f"loading tokenizer from {model_path}")
    preparer = RequestPreparer.load(config.model_name, model_path, config.trust_remote_code,
                                    config.tool_parser, config.reasoning_inline,
                                    config.context_length, config.chat_template_text,
                                    default_template_kwargs(config.chat_template_kwargs),
                                    model_sampling=config.sampling_defaults == "model",
                                    sampling_overrides=generation_overrides(
                                        config.override_generation_config))
    preparer.start_grammar_build()  # in the background, while the worker loads the model
    if config.chat_template_text:
        given = config.chat_template
        logger.info("chat template: --chat-template's (%s)",
                    f"inline, {len(given)} characters" if is_inline(given) else given)
    if preparer.sampling_defaults:
        logger.info("sampling a request leaves out: %s (generation_config.json%s)",
                    ", ".join(f"{k}={v}" for k, v in preparer.sampling_defaults.items()),
                    " and --override-generation-config" if config.override_generation_config
                    else "")
    if config.chat_template_kwargs:
        logger.info("chat template variables by default: %s", config.chat_template_kwargs)
    info = preparer.info
    logger.info("model %s: context %d tokens, vocab %d, eos ids %s", info.name,
                info.context_len, info.vocab_size, list(info.eos_token_ids))
    # Detected now, so an unknown --tool-parser stops the start-up with its message.
    syntax = preparer.turns.syntax
    logger.info("tool-call format: %s; reasoning markers: %s",
                syntax.tools.name if syntax.tools else "none",
                f"{syntax.reasoning.start} {syntax.reasoning.end}" if syntax.reasoning
                else ("harmony channels" if syntax.harmony else "none"))
    server = TokenizerServer(config, preparer)
    uvloop.run(server.run(reporter.ready))
