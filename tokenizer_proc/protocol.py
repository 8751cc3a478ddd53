"""Request bodies as pydantic models: the OpenAI API and the native /generate.

Strict types (no "16" for 16, no 1 for true) and unknown fields refused, so a typo is a
400 naming the field rather than a silently ignored setting. Parameters the engine does
not implement yet are declared so that their default values are accepted;
`prepare.check_unsupported` refuses any other value.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    # Real OpenAI pads chunks against length side channels; plain local output needs none.
    include_obfuscation: bool | None = None


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: the schema is enforced whatever `strict` says;
    `strict` refuses keywords the grammar cannot enforce (else they go unenforced)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: str  # "text", "json_object" or "json_schema"; checked in constraints.py
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    user: str | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False  # vLLM's name


class CompletionRequest(_SamplingFields):
    prompt: Any = None  # str | list[int] | one-element list of either; checked in prepare.py
    # The prompt's text before the completion's; with logprobs, the prompt's tokens too.
    echo: bool | None = None
    logprobs: int | None = None  # top-k per token, 0..20; 0: the sampled token's only
    response_format: ResponseFormat | None = None  # vLLM takes it on completions too
    best_of: int | None = None  # choices generated, of which the n best are returned
    # Not implemented yet: only their defaults are accepted (see prepare.py).
    suffix: str | None = None


class TextPart(_Strict):
    type: str
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        # Checked before the fields so an image part says "not supported", not "extra field".
        kind = data.get("type") if isinstance(data, dict) else None
        if kind is not None and kind != "text":
            raise ValueError(f"content parts of type {kind!r} are not supported; "
                             "only 'text' parts are")
        return data


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ChatToolCall(_Strict):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this message answers
    # An earlier answer's reasoning (as this server returned it); templates that show
    # past reasoning (Qwen3's) read it.
    reasoning_content: str | None = None

    def flat_content(self) -> str:
        """The content as one string: text parts joined by newlines (as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # the schema is enforced whenever a grammar writes the call


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


# The values of OpenAI's newer fields this server honours (chat and Responses alike): the
# default service tier; prefixes kept while memory allows (no time promised); an open
# model's one verbosity.
SERVICE_TIERS = (None, "auto", "default")
CACHE_RETENTIONS = (None, "in-memory", "in_memory")
VERBOSITIES = (None, "medium")

# OpenAI's reasoning effort levels (chat's `reasoning_effort`, Responses' `reasoning.effort`).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # 0..20, only with logprobs
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    # Cache hints: every prompt's prefix is cached here, whatever the key.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # OpenAI's newer fields SDKs fill in, taken at the values this server honours (see
    # prepare.CHAT_UNSUPPORTED): the default tier, medium verbosity, text output.
    service_tier: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    safety_identifier: str | None = None  # `user`'s successor: a tag, as `user` is
    # SGLang's switch: false keeps a reasoning model's thinking inline in `content`
    # (default: the server's --reasoning-inline, else apart in `reasoning_content`).
    separate_reasoning: bool | None = None
    # Extra variables for the chat template (vLLM's and SGLang's), e.g. enable_thinking.
    chat_template_kwargs: dict[str, Any] | None = None
    # Not implemented yet: only their defaults are accepted (see prepare.py).
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None


# --- /tokenize and /detokenize (vLLM's) -------------------------------------------------


class TokenizeRequest(_Strict):
    """A prompt (encoded as /v1/completions encodes one) or chat messages (rendered as
    /v1/chat/completions renders them); `add_special_tokens` defaults as each route
    encodes: the tokenizer's own (a BOS) for a prompt, none for a rendered chat."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None  # messages only; default true
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# --- the native API (/generate, /abort_request), SGLang's field names -------------------


class NativeSamplingParams(_Strict):
    """`sampling_params` of /generate; None means the same default as /v1/completions."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    stop: str | list[str] | None = None
    no_stop_trim: bool = False  # SGLang's name: keep the matched stop string in the text
    # Structured output, at most one (see constraints.py): a JSON schema (object or JSON
    # text), a regex, a GBNF grammar (llama.cpp syntax, SGLang's `ebnf`) or a Lark grammar.
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    lark: str | None = None
    n: int | None = None  # outputs of the prompt (1..16): a list of n responses


class GenerateBody(_Strict):
    """POST /generate: exactly one of `text` and `input_ids`."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    # The request id, for /abort_request; chosen by the server when absent.
    rid: str | None = Field(default=None, min_length=1, max_length=256)
    # Logprobs, SGLang's fields: of each output token (and its top `top_logprobs_num`),
    # and of the prompt's tokens from `logprob_start_len` on (-1: none); token texts
    # only with return_text_in_logprobs.
    return_logprob: bool | None = None
    top_logprobs_num: int | None = None
    logprob_start_len: int | None = None
    return_text_in_logprobs: bool = False


class AbortBody(_Strict):
    """POST /abort_request."""

    rid: str
