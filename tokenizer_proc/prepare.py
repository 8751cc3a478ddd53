"""Request validation and conversion: API bodies in, `TokenizedRequest` out.

Pure logic (a tokenizer and the model facts, no sockets), shared by the HTTP API and the
ZMQ front so both refuse the same requests with the same messages.

Numeric fields, each a 400 naming it when out of range; clamped only where a value past
the limit keeps a clear meaning (marked *):
  max_tokens >= 1 (0 for echo/scoring), prompt + max_tokens <= context; min_tokens 0..max;
  n 1..16; best_of n..16; logprobs, top_logprobs 0..20; seed 0..2**63-1;
  token ids (prompt, input_ids, stop_token_ids, logit_bias keys) 0..vocab-1;
  top_k -1 or 0: off, * >= vocab: off; temperature 0..float32 max, * < 1e-5: greedy;
  top_p (0, 1], * < 1e-8: 1e-8; min_p [0, 1]; frequency, presence [-2, 2];
  repetition_penalty [0.01, 100]; logit_bias values [-100, 100]; stop: 16 of 1..256 chars.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, TypeVar

import msgspec
from pydantic import BaseModel

from ipc.config import json_object_flag
from ipc.messages.client import GenerateRequest
from ipc.messages.common import SamplingParams
from ipc.messages.to_scheduler import TokenizedRequest
from kiln_common.llguidance_tokenizer import ll_tokenizer, structured_output_supported
from kiln_common.model_info import SAMPLING_FIELDS, ModelInfo, load_model_info
from tokenizer_proc.assistant_parser import ParseSpec
from tokenizer_proc.chat_template import (TEMPLATE_EFFORTS, template_messages,
                                          template_variables, text_arguments,
                                          thinking_switch)
from tokenizer_proc.constraints import (Constraint, GrammarCompiler, native_constraint,
                                        response_format_constraint)
from tokenizer_proc.conversation import Conversation, FunctionTool, chat_conversation
from tokenizer_proc.errors import RequestError
from tokenizer_proc.protocol import (CACHE_RETENTIONS, SERVICE_TIERS, VERBOSITIES,
                                     ChatCompletionRequest, CompletionRequest, GenerateBody,
                                     TokenizeRequest)
from tokenizer_proc.tool_syntax import chat_template_source, detect_syntax
from tokenizer_proc.tool_grammar import GrammarTool, arguments_schema
from tokenizer_proc.turn_plan import TurnPlan, TurnPlanner, special_tokens

logger = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16
# Seeds travel as int64; the worker folds any of them into its 32-bit RNG key
# (worker_proc.runner._fold_seed), so every value in range samples.
_MAX_SEED = 2**63

_IsDefault = Callable[[Any], bool]
R = TypeVar("R")


def _empty(value: Any) -> bool:
    # None, 0, 0.0, False, "", [] and {} all mean "feature not used".
    return not value


def _auto_or_none(value: Any) -> bool:
    return value is None or value in ("none", "auto")


# Parameters the engine does not implement yet, each with the test for its default.
_COMMON_UNSUPPORTED: dict[str, _IsDefault] = {}
COMPLETION_UNSUPPORTED: dict[str, _IsDefault] = {
    **_COMMON_UNSUPPORTED, "suffix": _empty,
}
CHAT_UNSUPPORTED: dict[str, _IsDefault] = {
    # The legacy spelling of tools (deprecated by OpenAI): use `tools`.
    **_COMMON_UNSUPPORTED, "functions": _empty, "function_call": _auto_or_none,
    # OpenAI's stored completions (read back by id, for evals) are not kept here; the
    # metadata that tags them is only taken where nothing is stored (as OpenAI ignores it).
    "store": _empty,
    "prompt_cache_retention": lambda v: v in CACHE_RETENTIONS,
    "service_tier": lambda v: v in SERVICE_TIERS,
    # An open model has no verbosity control, nor other output modalities.
    "verbosity": lambda v: v in VERBOSITIES,
    "modalities": lambda v: v in (None, ["text"]),
}

# The native /generate: top-level fields, then fields of its `sampling_params`.
# (None left today: every field GenerateBody declares is implemented.)
NATIVE_UNSUPPORTED: dict[str, _IsDefault] = {}
NATIVE_SAMPLING_UNSUPPORTED: dict[str, _IsDefault] = {}
_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values
_MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's chat limit; its completions' is 5)
_PENALTY_LIMIT = 2.0  # OpenAI's range for frequency and presence penalties
# NOTE: the worker samples in float32 with top_k as int32 (worker_proc/sampling.py); the
# bounds below keep every value one it takes, and keep its logits free of inf and NaN.
_FLOAT32_MAX = 3.4028234663852886e38
# Logits divided by a smaller temperature can overflow float32 to inf (then NaN in the
# softmax); sampling that cold is greedy in all but exact ties, so it is greedy (SGLang's
# rule; vLLM raises such temperatures to 0.01 instead).
_GREEDY_BELOW = 1e-5
# A top_p under the most likely token's probability (at least 1/vocab) keeps only that
# token; float32 would round a tinier top_p to 0, which keeps none, so it is raised to this.
_MIN_TOP_P = 1e-8
# The repetition penalty divides or multiplies float32 logits; in this range a logit
# moves at most 100-fold and cannot overflow. HF and vLLM take any value > 0, SGLang caps
# it at 2; useful values lie near 1.
_REPETITION_RANGE = (0.01, 100.0)
MAX_STOPS = 16  # OpenAI takes 4
MAX_STOP_CHARS = 256
MAX_CHOICES = 16  # n and best_of


def check_unsupported(body: BaseModel, table: dict[str, _IsDefault]) -> None:
    """Refuse any not-yet-implemented parameter set to something other than its default."""
    for name, is_default in table.items():
        if not is_default(getattr(body, name)):
            raise RequestError(
                f"Parameter '{name}' is not supported by this server yet; leave it out or "
                "set it to its default.", param=name, code="unsupported_parameter")


ConstrainedBody = CompletionRequest | ChatCompletionRequest | GenerateBody | GenerateRequest


def request_constraint(body: ConstrainedBody) -> Constraint | None:
    """A request's structured-output constraint: OpenAI's `response_format`, or the native
    parameters of /generate's `sampling_params` and of the ZMQ client."""
    if isinstance(body, GenerateBody):
        return native_constraint(body.sampling_params)
    if isinstance(body, GenerateRequest):
        return native_constraint(body)
    return response_format_constraint(body.response_format)


@dataclass(frozen=True)
class SamplingInput:
    """Sampling fields as the client sent them (None: not given)."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    max_tokens_param: str = "max_tokens"
    min_p: float | None = None
    logit_bias: dict[str, float] | dict[int, float] | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens_param: str = "min_tokens"
    stop: str | list[str] | None = None
    include_stop_str: bool = False
    logprobs: int = -1  # top-k logprobs per token, already checked; -1: off
    prompt_logprobs: int = -1  # top-k logprobs per prompt token, already checked; -1: off
    max_tokens_floor: int = 1  # 0 where only the prompt may be wanted (echo, scoring)
    constraint: Constraint | None = None  # structured output, compiled in sampling_params


@dataclass(frozen=True)
class PreparedTurn:
    """A chat turn (OpenAI chat, Responses, Messages): the engine request and what its
    output is parsed for."""

    request: TokenizedRequest
    parse: ParseSpec


class RequestPreparer:
    """Turns validated API bodies into `TokenizedRequest`s, refusing what the engine can't do.

    `tool_parser` ("auto": detected from the tokenizer) names the model's tool-call
    format; `reasoning_inline` keeps reasoning in the content unless a request says
    otherwise; `chat_template` (Jinja text) replaces the tokenizer's own template;
    `template_kwargs` are template variables every request gets unless it sets them;
    `model_sampling`: the sampling fields a request leaves out take the model's
    generation_config.json values (else OpenAI's defaults)."""

    def __init__(self, tokenizer: Any, info: ModelInfo,
                 grammars: GrammarCompiler | None = None, tool_parser: str = "auto",
                 reasoning_inline: bool = False, chat_template: str = "",
                 template_kwargs: dict[str, Any] | None = None,
                 model_sampling: bool = True,
                 sampling_overrides: dict[str, Any] | None = None) -> None:
        if chat_template:
            tokenizer.chat_template = chat_template
        self._tokenizer = tokenizer
        self._template_kwargs = dict(template_kwargs or {})
        # What a request leaves out: the model's recommended sampling (model_sampling),
        # each value checked as a request's would be, else OpenAI's defaults; the
        # server's overrides (already checked) over either.
        model = (_checked_defaults(info.sampling_defaults, info.vocab_size)
                 if model_sampling else {})
        self.sampling_defaults = {**model, **(sampling_overrides or {})}
        self.info = info
        self.grammars = grammars or GrammarCompiler(
            lambda: ll_tokenizer(tokenizer, info.eos_token_ids))
        self._thread: ThreadPoolExecutor | None = None
        self._tool_parser = tool_parser
        self.reasoning_inline = reasoning_inline

    @functools.cached_property
    def turns(self) -> TurnPlanner:
        """The model's tool and reasoning syntax, detected on first use."""
        return TurnPlanner(detect_syntax(self._tokenizer, self._tool_parser),
                           special_tokens(self._tokenizer))

    async def run(self, entry: Callable[..., R], *args: Any) -> R:
        """Call an entry point (or echo_text) on the preparer's own thread, off the event
        loop: tokenizing a long prompt (~100 ms for 80k tokens) there would stall every
        other request's stream. One thread, so the tokenizer (a Hugging Face fast
        tokenizer is not safe to call from several threads at once) has one caller."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        return await asyncio.get_running_loop().run_in_executor(
            self._thread, functools.partial(entry, *args))

    def start_grammar_build(self) -> None:
        """Process start-up: build llguidance's tokenizer in the background, unless this
        tokenizer is one llguidance cannot use (see GrammarCompiler.start_building)."""
        if structured_output_supported(self._tokenizer):
            self.grammars.start_building()

    async def prevalidate(self, body: ConstrainedBody) -> None:
        """Validate the body's constraint off the event loop; call it right before the
        body's entry point, which then finds the verdict. Raises nothing: the entry point
        raises every error, in its usual order."""
        try:
            constraint = request_constraint(body)
        except RequestError:
            return
        if constraint is not None:
            await self.grammars.prevalidate(constraint)

    @classmethod
    def load(cls, name: str, model_path: str, trust_remote_code: bool = False,
             tool_parser: str = "auto", reasoning_inline: bool = False,
             context_length: int = 0, chat_template: str = "",
             template_kwargs: dict[str, Any] | None = None,
             model_sampling: bool = True,
             sampling_overrides: dict[str, Any] | None = None) -> "RequestPreparer":
        """Load the model's tokenizer and facts from its directory (context_length: the
        server's limit, 0 for the model's; the rest as the constructor takes them)."""
        from transformers import AutoTokenizer  # slow import, only where needed

        tokenizer = AutoTokenizer.from_pretrained(model_path,
                                                  trust_remote_code=trust_remote_code)
        return cls(tokenizer, load_model_info(name, model_path, tokenizer, context_length),
                   tool_parser=tool_parser, reasoning_inline=reasoning_inline,
                   chat_template=chat_template, template_kwargs=template_kwargs,
                   model_sampling=model_sampling, sampling_overrides=sampling_overrides)

    # --- entry points -------------------------------------------------------------

    def completion(self, body: CompletionRequest, rid: str) -> TokenizedRequest:
        self._check_common(body, COMPLETION_UNSUPPORTED)
        ids = self.prompt_ids(body.prompt)
        k = _completion_logprobs(body)
        # best_of ranks its choices by their tokens' logprobs, asked for or not.
        ranked = completion_choices(body).ranked
        sampling = replace(_sampling_input(body, body.max_tokens),
                           logprobs=max(k, 0) if ranked else k,
                           prompt_logprobs=k if body.echo else -1,
                           max_tokens_floor=0 if body.echo else 1,
                           constraint=request_constraint(body))
        return self._request(rid, ids, sampling, self._completion_default(ids), "prompt",
                             body.skip_special_tokens)

    def echo_text(self, body: CompletionRequest, ids: list[int]) -> str:
        """What `echo` puts before the completion: the prompt as sent (decoded if ids)."""
        prompt = body.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        return self._tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens)

    def chat(self, body: ChatCompletionRequest, rid: str) -> TokenizedRequest:
        return self.chat_turn(body, rid).request

    def chat_turn(self, body: ChatCompletionRequest, rid: str) -> PreparedTurn:
        self._check_common(body, CHAT_UNSUPPORTED)
        conversation = chat_conversation(body, self.reasoning_inline)
        # max_completion_tokens replaced max_tokens in OpenAI's chat API.
        if body.max_completion_tokens is not None:
            sampling = _sampling_input(body, body.max_completion_tokens, "max_completion_tokens")
        else:
            sampling = _sampling_input(body, body.max_tokens)
        sampling = replace(sampling, logprobs=_chat_logprobs(body),
                           constraint=request_constraint(body))
        return self.turn(conversation, sampling, rid, body.skip_special_tokens)

    def turn(self, conversation: Conversation, sampling: SamplingInput, rid: str,
             skip_special_tokens: bool = True) -> PreparedTurn:
        """Any chat-like API's request: template (with its tools), the tool grammar, the
        engine request and what its output is parsed for."""
        prompt = self._render(conversation)
        ids = self.checked_ids(list(self._tokenizer.encode(prompt, add_special_tokens=False)),
                               conversation.messages_param)
        plan = self.turns.plan(conversation, prompt)
        if plan.constraint is not None:
            if sampling.constraint is not None:
                raise _two_grammars(sampling.constraint.param, plan.constraint.param,
                                    conversation)
            sampling = replace(sampling, constraint=plan.constraint)
        # A turn without max_tokens runs to the context's end, or the model's own length.
        default = min(self.info.context_len - len(ids),
                      self.sampling_defaults.get("max_new_tokens", self.info.context_len))
        try:
            request = self._request(rid, ids, sampling, default, conversation.messages_param,
                                    skip_special_tokens and not plan.keep_special_tokens)
        except RequestError as exc:
            loosened = self._loosened(conversation, plan, exc)
            if loosened is None:
                raise
            return self.turn(loosened, replace(sampling, constraint=None), rid,
                             skip_special_tokens)
        return PreparedTurn(request, plan.parse)

    def _loosened(self, conversation: Conversation, plan: TurnPlan,
                  error: RequestError) -> Conversation | None:
        """After the tools' grammar failed to compile: the conversation with each tool that
        is not strict and whose schema does not compile alone held to a JSON object (its
        calls still parse); None when no such tool explains the failure."""
        if (error.code != "invalid_grammar" or plan.constraint is None
                or plan.constraint.param not in (conversation.tools_param,
                                                 conversation.tool_choice_param)):
            return None
        tools, loosened = [], []
        for i, tool in enumerate(conversation.tools):
            if not (tool.strict or tool.loose) and not self._schema_compiles(tool, i, conversation):
                tool = replace(tool, loose=True)
                loosened.append(tool.name)
            tools.append(tool)
        if not loosened:
            return None
        logger.warning("tools %s: schemas the grammar cannot take (%s); their calls are held "
                       "to a JSON object", ", ".join(loosened), error.message)
        return replace(conversation, tools=tuple(tools))

    def _schema_compiles(self, tool: FunctionTool, i: int, conversation: Conversation) -> bool:
        schema = arguments_schema(GrammarTool(tool.name, tool.parameters or {}, tool.strict))
        try:
            self.grammars.compile(Constraint("json_schema", schema,
                                             f"{conversation.tools_param}[{i}]"))
        except RequestError:
            return False
        return True

    def _reasoning_kwargs(self, conversation: Conversation, source: str) -> dict[str, Any]:
        """Thinking asked on or off, and the reasoning effort, as the model's template
        takes them. Its switch (`enable_thinking`, Qwen3's and most; `thinking`,
        DeepSeek V3.1's) carries thinking on or off. The effort: low, medium or high in
        the template's `reasoning_effort` variable (GPT-OSS's, which knows those three);
        none or minimal as thinking off, or as nothing where the model does not reason at
        all; medium, the default, as thinking on (over a server default that turned it
        off), else nothing. Any other effort is refused: the model has no such control."""
        variables = template_variables(source)
        switch = thinking_switch(variables)
        out: dict[str, Any] = {}
        if conversation.thinking is not None and switch:
            out[switch] = conversation.thinking
        effort = conversation.reasoning_effort
        if effort is None:
            return out
        if "reasoning_effort" in variables and effort in TEMPLATE_EFFORTS:
            return {**out, "reasoning_effort": effort}
        if effort in ("none", "minimal"):
            if switch:
                return {**out, switch: False}
            syntax = self.turns.syntax
            if syntax.reasoning is None and not syntax.harmony:
                return out
        elif effort == "medium":
            return {**out, switch: True} if switch else out
        param = conversation.reasoning_effort_param
        if "reasoning_effort" in variables:
            why = "takes reasoning effort low, medium or high only"
        else:
            why = ("has no control of reasoning effort (no 'reasoning_effort' variable"
                   + (", nor a thinking switch)" if not switch else ")"))
        raise RequestError(f"This model's chat template {why}, so {effort!r} cannot be "
                           f"honoured; leave '{param}' out or set it to 'medium'.",
                           param=param, code="unsupported_value")

    def count_tokens(self, conversation: Conversation) -> int:
        """The prompt tokens a conversation takes (Anthropic's count_tokens)."""
        prompt = self._render(conversation)
        return len(self._tokenizer.encode(prompt, add_special_tokens=False))

    def generate(self, message: GenerateRequest, rid: str) -> TokenizedRequest:
        """The ZMQ front's request: text or token ids plus explicit sampling fields."""
        ids, param = self.text_or_ids(message.prompt, message.input_ids, "prompt")
        m = message
        prompt_k = _top_k_logprobs(m.prompt_logprobs, "prompt_logprobs")
        sampling = SamplingInput(
            m.max_tokens, m.temperature, m.top_p, m.top_k, m.seed, min_p=m.min_p,
            logit_bias=m.logit_bias, repetition_penalty=m.repetition_penalty,
            frequency_penalty=m.frequency_penalty, presence_penalty=m.presence_penalty,
            min_tokens=m.min_tokens, stop_token_ids=m.stop_token_ids, ignore_eos=m.ignore_eos,
            stop=m.stop, include_stop_str=m.include_stop_str_in_output,
            logprobs=_top_k_logprobs(m.logprobs, "logprobs"), prompt_logprobs=prompt_k,
            # Scoring a prompt needs no completion, as on the native /generate.
            max_tokens_floor=0 if prompt_k >= 0 else 1,
            constraint=request_constraint(m))
        return self._request(rid, ids, sampling, self._completion_default(ids), param,
                             message.skip_special_tokens)

    def native(self, body: GenerateBody, rid: str) -> TokenizedRequest:
        """The native /generate: text or token ids plus SGLang-style `sampling_params`."""
        check_unsupported(body, NATIVE_UNSUPPORTED)
        ids, param = self.text_or_ids(body.text, body.input_ids, "text")
        k, prompt_k = _native_logprobs(body, len(ids))
        sp = body.sampling_params
        with _nested_params("sampling_params", top_level=param):
            check_unsupported(sp, NATIVE_SAMPLING_UNSUPPORTED)
            sampling = SamplingInput(
                sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed, "max_new_tokens",
                min_p=sp.min_p, logit_bias=sp.logit_bias,
                repetition_penalty=sp.repetition_penalty,
                frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
                min_tokens=sp.min_new_tokens, stop_token_ids=sp.stop_token_ids,
                ignore_eos=sp.ignore_eos, min_tokens_param="min_new_tokens", stop=sp.stop,
                include_stop_str=sp.no_stop_trim, logprobs=k, prompt_logprobs=prompt_k,
                max_tokens_floor=0 if prompt_k >= 0 else 1,
                constraint=request_constraint(body))
            return self._request(rid, ids, sampling, self._completion_default(ids), param,
                                 sp.skip_special_tokens)

    def native_choices(self, body: GenerateBody) -> int:
        """`sampling_params.n` of /generate, checked like the OpenAI routes' `n`."""
        with _nested_params("sampling_params", top_level=""):
            return choice_count(body.sampling_params.n)

    def text_or_ids(self, text: str | None, ids: list[int] | None,
                    text_param: str) -> tuple[list[int], str]:
        """Token ids from exactly one of text and ids, and the name of the one given."""
        if (text is None) == (ids is None):
            raise RequestError(f"Give exactly one of '{text_param}' and 'input_ids'.",
                               param=text_param)
        if text is not None:
            return self.text_ids(text, text_param), text_param
        return self.checked_ids(ids or [], "input_ids"), "input_ids"

    def _completion_default(self, ids: list[int]) -> int:
        # An explicit max_tokens is checked against the context; the implicit 16 is not
        # the client's wish, so it shrinks to the room left rather than failing.
        return min(COMPLETION_DEFAULT_MAX_TOKENS, self.info.context_len - len(ids))

    # --- prompts --------------------------------------------------------------------

    def prompt_ids(self, prompt: Any) -> list[int]:
        """Token ids of a completions `prompt`: a string, ids, or a one-element list of either."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if prompt is None:
            raise RequestError("Missing required parameter: 'prompt'.", param="prompt",
                               code="missing_required_parameter")
        if isinstance(prompt, str):
            return self.text_ids(prompt, "prompt")
        if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
            return self.checked_ids(prompt, "prompt")
        if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
            raise RequestError("Batched prompts are not supported; send one prompt per "
                               "request.", param="prompt", code="unsupported_value")
        raise RequestError("'prompt' must be a string, a list of token ids, or a one-element "
                           "list of either.", param="prompt", code="invalid_type")

    def text_ids(self, text: str, param: str) -> list[int]:
        ids = list(self._tokenizer.encode(text)) if text else []
        if not ids:
            raise RequestError(f"'{param}' must not be empty.", param=param)
        return ids

    def checked_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise RequestError(f"'{param}' must not be empty.", param=param)
        return self.vocab_ids(ids, param)

    def tokenize(self, body: TokenizeRequest) -> list[int]:
        """/tokenize: the ids a prompt or a chat is fed to the model as (by default
        exactly those of /v1/completions or /v1/chat/completions)."""
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("Give exactly one of 'prompt' and 'messages'.", param="prompt")
        specials = body.add_special_tokens
        if body.prompt is not None:
            chat_only = [name for name, value in (
                ("tools", body.tools), ("chat_template_kwargs", body.chat_template_kwargs),
                ("add_generation_prompt", body.add_generation_prompt)) if value is not None]
            if chat_only:
                raise RequestError(f"'{chat_only[0]}' applies to 'messages' only.",
                                   param=chat_only[0])
            return list(self._tokenizer.encode(body.prompt,
                                               add_special_tokens=specials is not False))
        chat = ChatCompletionRequest(model=body.model, messages=body.messages or [],
                                     tools=body.tools,
                                     chat_template_kwargs=body.chat_template_kwargs)
        prompt = self._render(chat_conversation(chat, self.reasoning_inline),
                              generation_prompt=body.add_generation_prompt is not False)
        return list(self._tokenizer.encode(prompt, add_special_tokens=bool(specials)))

    def detokenize(self, ids: list[int]) -> str:
        """/detokenize: the text of token ids (special tokens kept)."""
        return self._tokenizer.decode(self.vocab_ids(ids, "tokens"))

    def token_strs(self, ids: list[int]) -> list[str]:
        return list(self._tokenizer.convert_ids_to_tokens(ids))

    def _render(self, conversation: Conversation, generation_prompt: bool = True) -> str:
        """The chat template's text (with the assistant prompt unless generation_prompt is
        false and, when calls are allowed, the tools). The template writes any BOS it
        wants, so the text is encoded without adding one."""
        param = conversation.messages_param
        if not conversation.messages:
            raise RequestError(f"'{param}' must contain at least one message.", param=param)
        if not getattr(self._tokenizer, "chat_template", None):
            raise RequestError("This model has no chat template; use /v1/completions.",
                               param=param)
        tools = ([t.template_dict() for t in conversation.tools]
                 if conversation.calls_tools else None)
        # The server's defaults, the effort's variables, then the request's own.
        source = chat_template_source(self._tokenizer)
        reasoning = self._reasoning_kwargs(conversation, source)
        kwargs = {**self._template_kwargs, **reasoning, **conversation.template_kwargs}
        messages = template_messages(conversation.messages, source)

        def render(chat: list[dict[str, Any]], variables: dict[str, Any]) -> str:
            return self._tokenizer.apply_chat_template(
                chat, tools=tools, tokenize=False,
                add_generation_prompt=generation_prompt and not conversation.continue_final,
                continue_final_message=conversation.continue_final, **variables)

        try:
            return render(messages, kwargs)
        # Templates ship with the model and may raise anything on input they dislike
        # (jinja's raise_exception for wrong role order, TypeError, ...).
        except Exception as exc:  # noqa: BLE001
            error = exc
        # Most templates write a past call's arguments with tojson (a dict); some join them
        # as text (DeepSeek V3.1's: string + dict is a TypeError): those get JSON text.
        as_text = text_arguments(messages)
        if as_text is not messages:
            try:
                return render(as_text, kwargs)
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
        if conversation.reasoning_effort is not None and reasoning:
            # The template refused the effort itself, if it takes the request without it.
            try:
                render(messages, {**self._template_kwargs, **conversation.template_kwargs})
            except Exception:  # noqa: BLE001 - not the effort's doing
                pass
            else:
                effort = conversation.reasoning_effort_param
                raise RequestError(f"The chat template rejected '{effort}' "
                                   f"{conversation.reasoning_effort!r}: {error}",
                                   param=effort) from error
        raise RequestError(f"The chat template rejected the {param}: {error}",
                           param=param) from error

    # --- sampling and limits --------------------------------------------------------

    def _check_common(self, body: CompletionRequest | ChatCompletionRequest,
                      unsupported: dict[str, _IsDefault]) -> None:
        # `model` is not checked: this server has one model and answers under its name
        # whatever was asked (the launcher's own tests send placeholder names).
        check_unsupported(body, unsupported)
        if body.stream_options is not None and not body.stream:
            raise RequestError("'stream_options' is only allowed when 'stream' is true.",
                               param="stream_options")

    def _request(self, rid: str, ids: list[int], sampling: SamplingInput, default_max: int,
                 prompt_param: str, skip_special_tokens: bool) -> TokenizedRequest:
        params = self.sampling_params(sampling, len(ids), default_max, prompt_param)
        return TokenizedRequest(rid=rid, input_ids=ids, sampling=params,
                                stop_token_ids=self.stop_ids(sampling),
                                skip_special_tokens=skip_special_tokens,
                                stop=_stop_strings(sampling.stop),
                                include_stop_str_in_output=sampling.include_stop_str)

    def stop_ids(self, s: SamplingInput) -> list[int]:
        """The ids that end the request: EOS (unless ignore_eos), then the client's own."""
        extra = self.vocab_ids(s.stop_token_ids or [], "stop_token_ids")
        eos = [] if s.ignore_eos else list(self.info.eos_token_ids)
        return list(dict.fromkeys(eos + extra))

    def sampling_params(self, s: SamplingInput, prompt_len: int, default_max: int,
                        prompt_param: str) -> SamplingParams:
        if s.max_tokens is not None and s.max_tokens < s.max_tokens_floor:
            raise RequestError(f"'{s.max_tokens_param}' must be at least {s.max_tokens_floor}.",
                               param=s.max_tokens_param)
        # Without max_tokens the prompt must still leave room for one token; the defaults
        # never exceed the room left.
        requested = 1 if s.max_tokens is None else s.max_tokens
        self._check_room(prompt_len, requested, prompt_param, s.max_tokens_param)
        max_tokens = default_max if s.max_tokens is None else s.max_tokens
        d = self.sampling_defaults.get
        return SamplingParams(
            temperature=_temperature(_given(s.temperature, d("temperature"))),
            top_p=_top_p(_given(s.top_p, d("top_p"))),
            top_k=_top_k(_given(s.top_k, d("top_k")), self.info.vocab_size),
            seed=_seed(s.seed), max_new_tokens=max_tokens,
            min_p=_min_p(_given(s.min_p, d("min_p"))), logit_bias=self.logit_bias(s.logit_bias),
            repetition_penalty=_repetition_penalty(_given(s.repetition_penalty,
                                                          d("repetition_penalty"))),
            frequency_penalty=_penalty(s.frequency_penalty, "frequency_penalty"),
            presence_penalty=_penalty(s.presence_penalty, "presence_penalty"),
            min_tokens=_min_tokens(s.min_tokens, max_tokens, s.min_tokens_param),
            logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs, grammar=self._grammar(s))

    def _grammar(self, s: SamplingInput) -> str | None:
        """The request's llguidance grammar, or None; refuses settings that fight one: a
        finished grammar allows only EOS, so EOS must end the request and may not be held
        back."""
        c = s.constraint
        if c is None:
            return None
        if s.ignore_eos:
            raise RequestError(f"'ignore_eos' cannot be combined with '{c.param}': a "
                               "finished grammar allows only EOS.", param="ignore_eos")
        if s.min_tokens:
            raise RequestError(f"'{s.min_tokens_param}' cannot be combined with '{c.param}': "
                               "the grammar may finish sooner.", param=s.min_tokens_param)
        return self.grammars.compile(c)

    def logit_bias(self, bias: dict[str, float] | dict[int, float] | None) -> dict[int, float]:
        """OpenAI's map of token id (a string in JSON) to a bias in [-100, 100]."""
        out: dict[int, float] = {}
        for key, value in (bias or {}).items():
            token = _token_key(key)
            self.vocab_ids([token], "logit_bias")
            if not _in_range(value, -_BIAS_LIMIT, _BIAS_LIMIT):
                raise RequestError(f"logit_bias values must be in [-100, 100]; got {value} "
                                   f"for token {token}.", param="logit_bias")
            out[token] = float(value)
        return out

    def vocab_ids(self, ids: list[int], param: str) -> list[int]:
        """ids, refused if any lies outside the vocabulary."""
        bad = next((t for t in ids if not 0 <= t < self.info.vocab_size), None)
        if bad is not None:
            raise RequestError(f"Token id {bad} in '{param}' is outside the vocabulary "
                               f"(0..{self.info.vocab_size - 1}).", param=param)
        return list(ids)

    def _check_room(self, prompt_len: int, max_tokens: int, prompt_param: str,
                    max_param: str) -> None:
        limit = self.info.context_len
        if prompt_len + max_tokens <= limit:
            return
        param = prompt_param if prompt_len >= limit else max_param
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_param}, "
            f"{max_tokens} for the completion, '{max_param}'). Please reduce the length of "
            f"the {prompt_param} or of the completion.", param=param,
            code="context_length_exceeded")


def _two_grammars(own: str, turn: str, conversation: Conversation) -> RequestError:
    """A request's own constraint (response_format) beside the turn's grammar (its tool
    calls, or its reasoning budget): one grammar a request."""
    if turn == conversation.reasoning_budget_param:
        return RequestError(f"'{own}' cannot be combined with '{turn}' (each is held by a "
                            "grammar); leave one out.", param=own)
    return RequestError(f"'{own}' cannot be combined with tool calls; leave it out or set "
                        f"'{conversation.tool_choice_param}' to 'none'.", param=own)


@contextlib.contextmanager
def _nested_params(prefix: str, top_level: str) -> Iterator[None]:
    """Name refused sampling fields by their place in the body ("sampling_params.top_p");
    `top_level` (the prompt's field) stays as it is."""
    try:
        yield
    except RequestError as exc:
        if exc.param is not None and exc.param != top_level:
            exc.param = f"{prefix}.{exc.param}"
        raise


def _sampling_input(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                    max_tokens_param: str = "max_tokens") -> SamplingInput:
    return SamplingInput(
        max_tokens, body.temperature, body.top_p, body.top_k, body.seed, max_tokens_param,
        min_p=body.min_p, logit_bias=body.logit_bias,
        repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty, min_tokens=body.min_tokens,
        stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, stop=body.stop,
        include_stop_str=body.include_stop_str_in_output)


def _completion_logprobs(body: CompletionRequest) -> int:
    """Legacy completions: `logprobs` is the top-k count (0 still reports the sampled
    token's); with `echo` the prompt's tokens get theirs too."""
    if body.logprobs is None:
        return -1
    if not 0 <= body.logprobs <= _MAX_LOGPROBS:
        raise RequestError(f"'logprobs' must be in [0, {_MAX_LOGPROBS}].", param="logprobs")
    return body.logprobs


def _native_logprobs(body: GenerateBody, prompt_len: int) -> tuple[int, int]:
    """/generate's (SGLang's) logprob fields: the top-k of the outputs and of the prompt
    (-1: off). `logprob_start_len` -1 (default) scores no prompt token, s >= 0 the
    prompt from position s on."""
    start = -1 if body.logprob_start_len is None else body.logprob_start_len
    k = body.top_logprobs_num or 0
    if not body.return_logprob:
        extra = next((name for name, used in (("top_logprobs_num", k != 0),
                                              ("logprob_start_len", start != -1),
                                              ("return_text_in_logprobs",
                                               body.return_text_in_logprobs)) if used), None)
        if extra is not None:
            raise RequestError(f"'{extra}' requires 'return_logprob' to be true.", param=extra)
        return -1, -1
    if not 0 <= k <= _MAX_LOGPROBS:
        raise RequestError(f"'top_logprobs_num' must be in [0, {_MAX_LOGPROBS}].",
                           param="top_logprobs_num")
    if not -1 <= start < prompt_len:
        raise RequestError(f"'logprob_start_len' must be -1 (outputs only) or a prompt "
                           f"position in [0, {prompt_len - 1}].", param="logprob_start_len")
    return k, (k if start >= 0 else -1)


def _chat_logprobs(body: ChatCompletionRequest) -> int:
    """Chat: `logprobs` switches them on, `top_logprobs` (0..20) asks for the top-k."""
    k = body.top_logprobs
    if k is not None and not body.logprobs:
        raise RequestError("'top_logprobs' requires 'logprobs' to be true.",
                           param="top_logprobs")
    if k is not None and not 0 <= k <= _MAX_LOGPROBS:
        raise RequestError(f"'top_logprobs' must be in [0, {_MAX_LOGPROBS}].",
                           param="top_logprobs")
    return (k or 0) if body.logprobs else -1


def choice_count(n: int | None) -> int:
    """The number of choices (engine requests) a request asks for: `n`, 1 to 16."""
    count = 1 if n is None else n
    if not 1 <= count <= MAX_CHOICES:
        raise RequestError(f"'n' must be in [1, {MAX_CHOICES}].", param="n")
    return count


@dataclass(frozen=True)
class Choices:
    """Completions' `n` and `best_of`: best_of choices are generated and the n with the
    highest log-probability per token returned (OpenAI's definition)."""

    n: int
    best_of: int

    @property
    def ranked(self) -> bool:
        return self.best_of > self.n


def completion_choices(body: CompletionRequest) -> Choices:
    n = choice_count(body.n)
    best_of = n if body.best_of is None else body.best_of
    if not n <= best_of <= MAX_CHOICES:
        raise RequestError(f"'best_of' must be at least 'n' ({n}) and at most {MAX_CHOICES}.",
                           param="best_of")
    if best_of > n and body.stream:
        # As OpenAI: the best are known only once every choice has ended.
        raise RequestError("'best_of' greater than 'n' cannot be streamed.", param="best_of")
    return Choices(n, best_of)


def fan_out(request: TokenizedRequest, n: int) -> list[TokenizedRequest]:
    """The engine requests of n choices of one prompt, ids `<rid>-<i>` (the radix cache
    computes the prompt once). A seeded request's choice i samples with seed + i; an
    unseeded one's choices each get their own random seed from the worker. Only choice 0
    scores the prompt (its prompt logprobs serve every choice), so the others may read
    the prompt from the cache."""
    if n == 1:
        return [request]
    seed = request.sampling.seed
    return [msgspec.structs.replace(
        request, rid=f"{request.rid}-{i}",
        sampling=msgspec.structs.replace(
            request.sampling, seed=None if seed is None else (seed + i) % _MAX_SEED,
            prompt_logprobs=request.sampling.prompt_logprobs if i == 0 else -1))
        for i in range(n)]


def _stop_strings(value: str | list[str] | None) -> list[str]:
    """OpenAI's `stop`: one string or a list of them; duplicates dropped."""
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > MAX_STOPS:
        raise RequestError(f"'stop' takes at most {MAX_STOPS} strings; got {len(stops)}.",
                           param="stop")
    if any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise RequestError(f"Each 'stop' string must be 1 to {MAX_STOP_CHARS} characters.",
                           param="stop")
    return list(dict.fromkeys(stops))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def generation_value(name: str, value: Any, vocab_size: int) -> float | int:
    """A generation_config field's value as a request's would be checked (a RequestError
    otherwise): top_k and max_new_tokens as integers."""
    if name not in SAMPLING_FIELDS:
        raise RequestError(f"'{name}' is not a sampling field ({', '.join(SAMPLING_FIELDS)}).",
                           param=name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{name}' must be a number.", param=name)
    if name in ("top_k", "max_new_tokens"):
        if not float(value).is_integer() or (name == "max_new_tokens" and value < 1):
            kind = "an integer" if name == "top_k" else "a positive integer"
            raise RequestError(f"'{name}' must be {kind}.", param=name)
        value = int(value)
    checks: dict[str, Callable[[Any], Any]] = {
        "temperature": _temperature, "top_p": _top_p, "min_p": _min_p,
        "repetition_penalty": _repetition_penalty,
        "top_k": lambda v: _top_k(v, vocab_size), "max_new_tokens": lambda v: v}
    checks[name](value)
    return value


def _checked_defaults(defaults: dict[str, float], vocab_size: int) -> dict[str, Any]:
    """The model's sampling defaults that a request could set itself; one out of range is
    dropped, with a warning (the model's file, not the client, is wrong)."""
    kept: dict[str, Any] = {}
    for name, value in defaults.items():
        try:
            kept[name] = generation_value(name, value, vocab_size)
        except RequestError as exc:
            logger.warning("generation_config.json's %s %r is not used: %s", name, value,
                           exc.message)
    return kept


def generation_overrides(value: str, vocab_size: int = 2**31 - 1) -> dict[str, Any]:
    """--override-generation-config: a JSON object of generation_config fields that win
    over the model's; raises ValueError naming what is wrong."""
    fields = json_object_flag("--override-generation-config", value)
    try:
        return {name: generation_value(name, v, vocab_size) for name, v in fields.items()}
    except RequestError as exc:
        raise ValueError(f"--override-generation-config: {exc.message}") from None


def _temperature(value: float | None) -> float:
    if value is None:
        return 1.0
    if not _in_range(value, 0.0, _FLOAT32_MAX):
        raise RequestError(f"'temperature' must be a number in [0, {_FLOAT32_MAX:.4g}].",
                           param="temperature")
    return 0.0 if value < _GREEDY_BELOW else float(value)


def _top_p(value: float | None) -> float:
    if value is None:
        return 1.0
    if not (_in_range(value, 0.0, 1.0) and value > 0):
        raise RequestError("'top_p' must be in (0, 1].", param="top_p")
    return max(float(value), _MIN_TOP_P)


def _top_k(value: int | None, vocab_size: int) -> int:
    # -1 is vLLM's spelling of "off", 0 is ours. A k at or past the vocabulary keeps every
    # token, so it means no limit too (as vLLM and HF clamp it); it must not reach the
    # worker, whose int32 cannot hold 2**31.
    if value is None or value == -1 or value >= vocab_size:
        return 0
    if value < 0:
        raise RequestError("'top_k' must be -1 or 0 (off) or a positive integer.",
                           param="top_k")
    return value


def _seed(value: int | None) -> int | None:
    if value is not None and not 0 <= value < _MAX_SEED:
        raise RequestError(f"'seed' must be in [0, {_MAX_SEED - 1}].", param="seed")
    return value


def _min_p(value: float | None) -> float:
    if value is None:
        return 0.0
    if not _in_range(value, 0.0, 1.0):
        raise RequestError("'min_p' must be in [0, 1].", param="min_p")
    return float(value)


def _repetition_penalty(value: float | None) -> float:
    if value is None:
        return 1.0
    low, high = _REPETITION_RANGE
    if not _in_range(value, low, high):
        raise RequestError(f"'repetition_penalty' must be in [{low}, {high:g}].",
                           param="repetition_penalty")
    return float(value)


def _penalty(value: float | None, param: str) -> float:
    if value is None:
        return 0.0
    if not _in_range(value, -_PENALTY_LIMIT, _PENALTY_LIMIT):
        raise RequestError(f"'{param}' must be in [-2, 2].", param=param)
    return float(value)


def _min_tokens(value: int | None, max_tokens: int, param: str) -> int:
    if value is None:
        return 0
    if not 0 <= value <= max_tokens:
        raise RequestError(f"'{param}' must be in [0, max tokens ({max_tokens})].", param=param)
    return value


def _in_range(value: float, low: float, high: float) -> bool:
    """low <= value <= high. The bounds are finite, so NaN and infinities are out; an
    integer too large for a float (10**400 as a temperature) compares exactly, where
    math.isfinite would raise."""
    return low <= value <= high


def _token_key(key: str | int) -> int:
    # Decimal digits only: int() would also take " 5", "+5", "1_0" and other scripts' digits.
    if isinstance(key, int):
        return key
    if not (key.isascii() and key.isdigit()):
        raise RequestError(f"logit_bias keys must be token ids; got {key[:40]!r}.",
                           param="logit_bias")
    try:
        return int(key)
    except ValueError:  # more digits than Python converts (4300)
        raise RequestError(f"logit_bias key {key[:20]}... is not a token id.",
                           param="logit_bias") from None


def _top_k_logprobs(k: int | None, param: str) -> int:
    """The ZMQ client's `logprobs` / `prompt_logprobs`: None off, else the top-k count
    (0 = only the token's own)."""
    if k is None:
        return -1
    if not 0 <= k <= _MAX_LOGPROBS:
        raise RequestError(f"'{param}' must be in [0, {_MAX_LOGPROBS}].", param=param)
    return k
