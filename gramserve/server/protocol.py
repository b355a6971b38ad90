"""Pydantic models of the OpenAI API (and SGLang's native /generate) requests we accept and responses we send."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_serializer, model_validator

# Ranges checked where a request is parsed, so no value can overflow a C integer further in.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # any 64-bit seed, signed or not
INT32_MAX = (1 << 31) - 1
MAX_NATIVE_TOP_LOGPROBS = 20  # /generate's top_logprobs_num, as chat's top_logprobs


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# --- requests --------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class SamplingFields(BaseModel):
    """Fields shared by chat and completions: OpenAI's, then the usual vLLM / SGLang extensions."""

    # Unknown fields are accepted and ignored, as OpenAI-compatible servers do; known fields are type-checked.
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    user: Optional[str] = None
    # extensions
    top_k: Optional[int] = Field(None, ge=-1, le=INT32_MAX)
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string ends the text
    # structured outputs (see gramserve/server/structured_outputs.py for every accepted spelling)
    response_format: Optional[dict[str, Any]] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    json_schema: Optional[Union[dict[str, Any], StrictBool, str]] = None  # true / false: JSON Schema's boolean schemas
    structural_tag: Optional[Union[dict[str, Any], str]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[dict[str, Any], StrictBool, str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    grammar_backend: Optional[str] = None
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)  # lower runs first
    # SGLang's way to pick a LoRA adapter by name (OpenAI clients pick it with `model`)
    lora_path: Optional[str] = Field(None, min_length=1, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """OpenAI's API marks its optional fields nullable, and clients and proxies send `null` for them: a null
        stands for the field's default (`"n": null` is n = 1), as if it was left out. Required fields stay null
        (and are refused)."""
        if not isinstance(data, dict) or None not in data.values():
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None
        }


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class FunctionCallSpec(BaseModel):
    """A call in an assistant message of the history (arguments as OpenAI sends them: a JSON string)."""

    model_config = ConfigDict(extra="allow")
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCallSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: Optional[str] = None
    type: str = "function"
    function: FunctionCallSpec


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[TextContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallSpec]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None  # "yes" is a 400, as at OpenAI


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: StrictBool = True
    separate_reasoning: bool = True  # SGLang: put the reasoning phase in reasoning_content
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]  # strict: true is not token 1
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None  # only best_of = n is served (the n samples are all returned)


class AbortRequest(BaseModel):
    """SGLang's /abort_request body."""

    rid: str = Field(min_length=1)


class NativeSamplingParams(BaseModel):
    """/generate's `sampling_params` (SGLang's names), output-constraint keys taken out: typed, unknown keys refused."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: Optional[int] = None
    min_new_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = Field(None, ge=-1, le=INT32_MAX)
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    sampling_seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)  # SGLang's name; wins over `seed`
    logit_bias: Optional[dict[str, float]] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    no_stop_trim: Optional[bool] = None  # SGLang's: the matched stop string ends the text


# sampling_params keys that constrain the output (structured_outputs.py reads them) rather than sample
NATIVE_GRAMMAR_KEYS = frozenset(
    {
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "choice",
        "grammar_backend",
        "response_format",
        "structured_outputs",
    }
)
# refused at /generate's top level, where they would be ignored: sampling_params keys, and OpenAI's / vLLM's names
# of them that clients used to those APIs put there
MISPLACED_NATIVE_KEYS = (
    frozenset(NativeSamplingParams.model_fields)
    | NATIVE_GRAMMAR_KEYS
    | {"n", "max_tokens", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend"}
)
_Rid = Annotated[str, Field(min_length=1, max_length=256)]


class GenerateRequest(BaseModel):
    """SGLang's native endpoint: text or input_ids plus a sampling_params dict; or a batch: a list of texts (or of
    id lists), with one sampling_params dict or one per prompt and one rid per prompt (native_batch.py splits it)."""

    model_config = ConfigDict(extra="allow")
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[StrictInt], list[list[StrictInt]]]] = None
    sampling_params: Union[dict[str, Any], list[dict[str, Any]]] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_NATIVE_TOP_LOGPROBS)
    return_text_in_logprobs: bool = False  # each logprob entry [logprob, id] gets the token's text
    logprob_start_len: int = -1  # SGLang's prompt logprobs from this position: not served (-1: none)
    rid: Optional[Union[_Rid, list[_Rid]]] = None
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    lora_path: Optional[str] = Field(None, min_length=1, max_length=256)  # a LoRA adapter's name

    @model_validator(mode="after")
    def _nothing_misplaced(self) -> "GenerateRequest":
        """SGLang's other top-level fields pass (extra="allow"); a sampling or constraint key there is refused: it
        would be ignored, and a `regex` beside `sampling_params` left the output unconstrained."""
        misplaced = sorted(set(self.model_extra or ()) & MISPLACED_NATIVE_KEYS)
        if misplaced:
            raise ValueError(f"{', '.join(misplaced)} must be inside sampling_params")
        return self


# --- responses -------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatLogprobToken]] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        # content is always present (null when the answer is only tool calls); the rest only when set.
        out = handler(self)
        return {k: v for k, v in out.items() if v is not None or k == "content"}


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    grammar_backend: Optional[str] = None  # which grammar backend constrained this output


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        # OpenAI omits absent delta fields instead of sending nulls.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None
    grammar_backend: Optional[str] = None  # on a constrained choice's last chunk: which backend constrained it


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    grammar_backend: Optional[str] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "gramserve"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRARequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)


class LoRAAdapterResponse(BaseModel):
    success: bool = True
    lora_name: str
    message: str
    loaded_adapters: list[str]
