"""OpenAI requests as the picker reads them: the model, the prompt's token ids, the namespace.

``RequestReader.read(path, body)`` reads a ``/v1/completions`` or ``/v1/chat/completions``
JSON body (streamed or not: ``"stream"`` only changes the response) into a ``PromptRequest``,
tokenizing its prompt as the engine does (``ChatTokenizer``). Any other path is routed on
load alone (no body is read). A request the engine would refuse gets a ``RequestError`` with
the HTTP status and an OpenAI error body: 400 for a body that is not a JSON object or a field
of the wrong type (the message names the field), 404 for a model the pool does not serve, 413
for a body over the limit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence

from .tokenization import ChatTokenizer, TemplateError

__all__ = ["CHAT_PATH", "COMPLETIONS_PATH", "PromptRequest", "RequestError", "RequestReader"]

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class RequestError(Exception):
    """A request the picker answers itself: ``status`` (4xx), ``message``, ``error_type``
    (OpenAI's ``type``) and ``code``.

    Args:
        status: The HTTP status.
        message: What is wrong, naming the field.
        error_type: OpenAI's error type.
        code: OpenAI's error code, or None.
    """

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code

    def body(self) -> bytes:
        """The OpenAI error object, as JSON bytes."""
        return json.dumps({"error": {"message": self.message, "type": self.error_type,
                                     "param": None, "code": self.code}}).encode("utf-8")


@dataclass(frozen=True)
class PromptRequest:
    """What the picker needs of a request.

    Attributes:
        kind: ``"chat"``, ``"completion"`` or ``"other"`` (a path the picker does not read).
        model: The model the request names (``""`` for ``"other"``).
        token_ids: The prompt's token ids, as the engine tokenizes it (empty for ``"other"``).
        lora: The LoRA adapter the model name stands for, or None (the base model).
        salt: The request's ``cache_salt``, or None.
        max_tokens: The output tokens it asks for at most (0: not given).
        stream: Whether it asked for a streamed response.
    """

    kind: str
    model: str = ""
    token_ids: Sequence[int] = ()
    lora: Optional[str] = None
    salt: Optional[str] = None
    max_tokens: int = 0
    stream: bool = False


OTHER = PromptRequest("other")


class RequestReader:
    """Reads request bodies into ``PromptRequest`` (see the module docstring).

    Args:
        tokenizer: The model's ``ChatTokenizer``.
        models: The model names the pool serves (the base model); empty: any name.
        loras: The LoRA adapter names the pool serves: a request naming one is tokenized
            like the base model and cached in the adapter's namespace.
        max_body_bytes: The largest body read, in bytes.
    """

    def __init__(self, tokenizer: ChatTokenizer, models: Sequence[str] = (),
                 loras: Sequence[str] = (), max_body_bytes: int = 4 << 20) -> None:
        self.tokenizer = tokenizer
        self.models = frozenset(models)
        self.loras = frozenset(loras)
        self.max_body_bytes = int(max_body_bytes)

    @staticmethod
    def kind_of(path: str) -> str:
        """``"chat"``, ``"completion"`` or ``"other"`` for a request path (its query
        dropped)."""
        path = path.split("?", 1)[0].rstrip("/")
        if path == CHAT_PATH:
            return "chat"
        if path == COMPLETIONS_PATH:
            return "completion"
        return "other"

    def too_large(self, size: int) -> RequestError:
        return RequestError(413, f"the request body has more than {self.max_body_bytes} "
                                 f"bytes (at least {size})")

    def read(self, path: str, body: bytes) -> PromptRequest:
        """Read one request.

        Args:
            path: The request's ``:path``.
            body: Its whole body.

        Returns:
            The ``PromptRequest``.

        Raises:
            RequestError: see the module docstring.
        """
        kind = self.kind_of(path)
        if kind == "other":
            return OTHER
        if len(body) > self.max_body_bytes:
            raise self.too_large(len(body))
        import msgspec

        try:
            data = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            raise RequestError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise RequestError(400, f"the request body must be a JSON object, got "
                                    f"{type(data).__name__}")
        model = data.get("model")
        if not isinstance(model, str) or not model:
            raise RequestError(400, "'model' must be a non-empty string")
        lora = None
        if model in self.loras:
            lora = model
        elif self.models and model not in self.models:
            raise RequestError(404, f"the model {model!r} does not exist here",
                               "NotFoundError", "model_not_found")
        salt = data.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise RequestError(400, "'cache_salt' must be a string")
        stream = data.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError(400, "'stream' must be a boolean")
        max_tokens = _max_tokens(data)
        try:
            if kind == "chat":
                ids = self._chat_ids(data)
            else:
                ids = self._completion_ids(data)
        except TemplateError as exc:
            raise RequestError(400, str(exc)) from None
        return PromptRequest(kind, model, ids, lora, salt, max_tokens, stream)

    def _chat_ids(self, data: dict) -> list:
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty array")
        tools = data.get("tools")
        if tools is not None and not (isinstance(tools, list)
                                      and all(isinstance(t, dict) for t in tools)):
            raise RequestError(400, "'tools' must be an array of objects")
        add_generation_prompt = data.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            raise RequestError(400, "'add_generation_prompt' must be a boolean")
        kwargs = data.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise RequestError(400, "'chat_template_kwargs' must be an object")
        documents = data.get("documents")
        tokenizer = self.tokenizer
        prepared = tokenizer.prepare_messages(messages, tools)
        return tokenizer.chat_ids(prepared, tools or None,
                                  add_generation_prompt=add_generation_prompt,
                                  documents=documents, template_kwargs=kwargs)

    def _completion_ids(self, data: dict) -> list:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and not _is_token_list(prompt):
            prompt = prompt[0]  # a batch: routed as its first prompt
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and _is_token_list(prompt):
            return prompt
        raise RequestError(400, "'prompt' must be a string, an array of token ids, or an "
                                "array of those")


def _is_token_list(value: list) -> bool:
    return all(type(item) is int and 0 <= item < (1 << 62) for item in value)


def _max_tokens(data: dict) -> int:
    for field in ("max_completion_tokens", "max_tokens"):
        value = data.get(field)
        if value is None:
            continue
        if type(value) is not int or value < 0:
            raise RequestError(400, f"'{field}' must be an integer >= 0")
        return value
    return 0
