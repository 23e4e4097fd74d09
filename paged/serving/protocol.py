"""The OpenAI API's requests and responses as pydantic models (guide §13), named as vLLM's
entrypoints/openai/protocol.py names them.

Requests: CompletionRequest (/v1/completions), ChatCompletionRequest (/v1/chat/completions), TokenizeRequest and
DetokenizeRequest (vLLM's /tokenize, /detokenize). Unknown fields are ignored, as OpenAI's and vLLM's servers do. The
models hold every check a field can make alone, its type (strict: "8" is not 8, true is not 1) and its range; a
request that breaks one gets a 400 whose `param` is the field (api_server.py's handler of RequestValidationError).
Checks across fields (greedy sampling with n > 1, a prompt against the context) stay with SamplingParams and the engine.

Responses: CompletionResponse, ChatCompletionResponse and their stream chunks (CompletionStreamResponse,
ChatCompletionStreamResponse), UsageInfo, ModelList, ErrorResponse. A field a response model names in `optional` is
left out of its JSON unless it was given (a choice's token_ids when the request did not ask for them, a chunk's
delta without a role); every other field is always there, null or not, as OpenAI's are.
"""

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_serializer

from paged.sampling_params import MAX_LOGPROBS, MAX_SEED

Number = StrictInt | StrictFloat
NonNegative = Annotated[Number, Field(ge=0)]
Fraction = Annotated[Number, Field(ge=0, le=1)]
NumLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- requests ---------------------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: every chunk carries the usage so far


class SamplingRequest(OpenAIBaseModel):
    """The fields both endpoints share."""

    model: StrictStr
    request_id: StrictStr | None = None  # vLLM's: the response id ends with it (an X-Request-Id header wins)
    frequency_penalty: Number | None = None  # these five: the server refuses all but their neutral values
    presence_penalty: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    n: Annotated[StrictInt, Field(ge=1)] = 1
    temperature: NonNegative | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Fraction | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False  # vLLM's: keep a stop string's or stop token's text
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool = False
    user: StrictStr | None = None


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]  # one, or a batch of several
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = 16  # 0 with echo: the prompt alone is scored
    logprobs: NumLogprobs | None = None  # the N most likely tokens at each position, besides the chosen one
    echo: StrictBool = False  # the prompt comes back before the completion, text and logprobs
    prompt_logprobs: NumLogprobs | None = None  # vLLM's: each prompt token's logprob and its N most likely others
    best_of: StrictInt | None = None  # completions to choose the n best from: only n itself here


class ChatCompletionContentPartTextParam(OpenAIBaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatCompletionMessageParam(OpenAIBaseModel):
    role: Literal["system", "user", "assistant"]
    content: StrictStr | list[ChatCompletionContentPartTextParam]  # a string, or text content parts (no images)

    def text(self) -> str:
        """The message's text; content parts joined by newlines, as vLLM joins them."""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatCompletionMessageParam] = Field(min_length=1)
    max_tokens: StrictInt | None = None  # these two: checked as the one the request gives (its max_tokens)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False  # each token's log-probability
    top_logprobs: NumLogprobs | None = None  # and its N most likely alternatives (needs logprobs)


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's /tokenize for a text prompt."""

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: StrictStr | None = None
    tokens: list[StrictInt]


# ---- responses --------------------------------------------------------------------------------------------


class OpenAIResponse(OpenAIBaseModel):
    optional: ClassVar[frozenset[str]] = frozenset()  # fields left out of the JSON unless given

    @model_serializer(mode="wrap")
    def _leave_out_unset(self, handler):
        return {
            key: value
            for key, value in handler(self).items()
            if key not in self.optional or key in self.model_fields_set
        }


class PromptTokenUsageInfo(OpenAIResponse):
    cached_tokens: int


class UsageInfo(OpenAIResponse):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokenUsageInfo

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "UsageInfo":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens),
        )


class CompletionResponseChoice(OpenAIResponse):
    optional = frozenset({"prompt_logprobs", "token_ids", "prompt_token_ids"})
    index: int
    text: str
    logprobs: dict | None  # tokens, token_logprobs, top_logprobs, text_offset
    finish_reason: str | None
    prompt_logprobs: list[dict | None] | None = None  # vLLM's, when asked: in a completion's first choice
    token_ids: list[int] | None = None  # vLLM's return_token_ids
    prompt_token_ids: list[int] | None = None


class CompletionResponse(OpenAIResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ChatMessage(OpenAIResponse):
    role: Literal["assistant"] = "assistant"
    content: str


class DeltaMessage(OpenAIResponse):
    optional = frozenset({"role", "content"})
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIResponse):
    optional = frozenset({"token_ids"})
    index: int
    message: ChatMessage
    logprobs: dict | None  # content (per token: token, logprob, bytes, top_logprobs), refusal
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatCompletionResponseStreamChoice(OpenAIResponse):
    optional = frozenset({"token_ids"})
    index: int
    delta: DeltaMessage
    logprobs: dict | None
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class ChatCompletionStreamResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIResponse):
    optional = frozenset({"max_model_len"})
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "paged"
    root: str
    parent: str | None
    max_model_len: int | None = None  # the base model's; an adapter's card leaves it out


class ModelList(OpenAIResponse):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(OpenAIResponse):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(OpenAIResponse):
    error: ErrorInfo
