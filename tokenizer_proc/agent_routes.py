"""The HTTP routes of the agent APIs: OpenAI's Responses and Anthropic's Messages.

As thin as the chat route: bodies are parsed here, turned into a `Conversation` by their
API module, prepared by `RequestPreparer.turn` (template, tool grammar, parse spec), run
through the manager, and shaped by the API's builder. Errors take each API's format (the
handlers in http_api choose it by path).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ipc.messages.to_tokenizer import TextOutput
from tokenizer_proc import messages_api, responses_api
from tokenizer_proc.constraints import response_format_constraint
from tokenizer_proc.errors import anthropic_error_body
from tokenizer_proc.http_api import (_EventStream, _parse, _raise_engine_error, _read_json,
                                     _until_disconnect)
from tokenizer_proc.manager import Collected, RequestStream, TokenizerManager, new_id
from tokenizer_proc.prepare import PreparedTurn, RequestPreparer, SamplingInput

SseSource = Callable[[RequestStream, TextOutput], AsyncIterator[str]]


class AgentRoutes:
    def __init__(self, manager: TokenizerManager, preparer: RequestPreparer,
                 store: responses_api.ResponseStore | None = None) -> None:
        self._manager = manager
        self._preparer = preparer
        self.store = store or responses_api.ResponseStore()

    def install(self, app: FastAPI) -> None:
        app.add_api_route("/v1/responses", self.responses, methods=["POST"])
        app.add_api_route("/v1/responses/{response_id}", self.get_response, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}", self.delete_response,
                          methods=["DELETE"])
        app.add_api_route("/v1/messages", self.messages, methods=["POST"])
        app.add_api_route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])

    # --- Responses ---

    async def responses(self, request: Request) -> Response:
        body = _parse(responses_api.ResponsesRequest, await _read_json(request))
        responses_api.check_unsupported(body)
        history = (self.store.get(body.previous_response_id).messages
                   if body.previous_response_id else [])
        conversation = responses_api.responses_conversation(body, history,
                                                            self._preparer.reasoning_inline)
        fmt = response_format_constraint(responses_api.text_constraint_format(body), "text.format")
        sampling = SamplingInput(body.max_output_tokens, body.temperature, body.top_p, None,
                                 None, "max_output_tokens", constraint=fmt)
        rid = new_id("resp", "_")
        prep = self._preparer
        turn = await prep.run(prep.turn, conversation, sampling, rid)
        builder = responses_api.ResponseBuilder(
            rid, responses_api.request_echo(body, prep.info.name, turn.request.sampling),
            turn.parse,
            seal_reasoning=responses_api.ENCRYPTED_REASONING in (body.include or []))
        store = body.store is not False

        def keep(usage_body: dict[str, Any]) -> None:
            if store:
                self.store.put(rid, responses_api.carried_messages(body, conversation)
                               + builder.output_messages(), usage_body)

        async def events(stream: RequestStream, first: TextOutput) -> AsyncIterator[str]:
            for event in builder.opening():
                yield _named_sse(event)
            async for output in _outputs_to_end(stream, first):
                if output.error is not None:
                    for event in builder.fail(output.error):
                        yield _named_sse(event)
                    return
                for event in builder.feed(output.text, len(output.token_ids)):
                    yield _named_sse(event)
                if output.finished:
                    closing = builder.finish(output.finish_reason, stream.usage(output))
                    keep(closing[-1]["response"])
                    for event in closing:
                        yield _named_sse(event)

        result = await self._run(request, turn, body.stream, events)
        if isinstance(result, Response):
            return result
        for text, tokens in result.pieces():  # as streamed: reasoning tokens are counted
            builder.feed(text, tokens)
        final = builder.finish(result.finish_reason, result.usage)[-1]["response"]
        keep(final)
        return JSONResponse(final)

    async def get_response(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id, "response_id").body

    async def delete_response(self, response_id: str) -> dict[str, Any]:
        self.store.get(response_id, "response_id")
        self.store.pop(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # --- Messages ---

    async def messages(self, request: Request) -> Response:
        body = _parse(messages_api.MessagesRequest, await _read_json(request))
        messages_api.check_unsupported(body)
        conversation = messages_api.messages_conversation(body, self._preparer.reasoning_inline)
        # max_tokens 0 computes (and caches) the prompt alone: Anthropic's cache warm-up.
        sampling = SamplingInput(body.max_tokens, body.temperature, body.top_p, body.top_k,
                                 None, stop=body.stop_sequences, max_tokens_floor=0)
        rid = new_id("msg", "_")
        prep = self._preparer
        turn = await prep.run(prep.turn, conversation, sampling, rid)
        builder = messages_api.MessageBuilder(rid, prep.info.name, turn.parse)
        prompt_tokens = len(turn.request.input_ids)

        async def events(stream: RequestStream, first: TextOutput) -> AsyncIterator[str]:
            for name, data in builder.opening(prompt_tokens):
                yield messages_api.anthropic_sse(name, data)
            async for output in _outputs_to_end(stream, first):
                if output.error is not None:
                    yield messages_api.anthropic_sse("error", anthropic_error_body(
                        output.error, 500))
                    return
                for name, data in builder.feed(output.text):
                    yield messages_api.anthropic_sse(name, data)
                if output.finished:
                    for name, data in builder.finish(output.finish_reason, output.stop_str,
                                                     stream.usage(output)):
                        yield messages_api.anthropic_sse(name, data)

        result = await self._run(request, turn, body.stream, events)
        if isinstance(result, Response):
            return result
        builder.feed(result.text)
        builder.finish(result.finish_reason, result.stop_str, result.usage)
        reason = messages_api.stop_reason(result.finish_reason, result.stop_str,
                                          builder.made_calls)
        return JSONResponse(builder.message(reason, result.stop_str, result.usage))

    async def count_tokens(self, request: Request) -> dict[str, int]:
        body = _parse(messages_api.CountTokensRequest, await _read_json(request))
        conversation = messages_api.messages_conversation(body, self._preparer.reasoning_inline)
        prep = self._preparer
        return {"input_tokens": await prep.run(prep.count_tokens, conversation)}

    # --- shared ---

    async def _run(self, request: Request, turn: PreparedTurn, streaming: bool,
                   events: SseSource) -> Response | Collected:
        """Submit the turn; a streamed response (the events of `events`) or the whole
        result. As in chat, the first output is awaited before the headers go out, so an
        engine refusal is still an error status."""
        stream = await self._manager.submit(turn.request)
        try:
            first = await _until_disconnect(request, stream.next())
            _raise_engine_error(first)
            if streaming:
                return _EventStream(events(stream, first), stream)
            result = await _until_disconnect(request, stream.collect(first))
        except BaseException:
            stream.close()
            raise
        _raise_engine_error(result)
        return result


async def _outputs_to_end(stream: RequestStream, first: TextOutput) -> AsyncIterator[TextOutput]:
    """A request's outputs from `first` on, ending with the finished or failed one."""
    output = first
    while True:
        yield output
        if output.finished or output.error is not None:
            return
        output = await stream.next()


def _named_sse(event: dict[str, Any]) -> str:
    """A Responses stream event: its type as the SSE event name, as OpenAI sends them."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"
