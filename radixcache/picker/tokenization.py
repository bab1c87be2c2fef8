"""``ChatTokenizer``: a model's prompts as its engine tokenizes them, without transformers.

A prompt's blocks match a worker's cached blocks only if the picker tokenizes exactly as the
engine did. ``ChatTokenizer.from_dir(path)`` reads a Hugging Face tokenizer directory:

- ``tokenizer.json``, loaded with the ``tokenizers`` library (the Rust tokenizer that
  transformers' fast tokenizers wrap): a completion's prompt is ``encode(text)`` with the
  special tokens its post-processor adds (the BOS of Llama-style models), as an engine's
  ``tokenizer(prompt)`` does;
- the chat template: ``chat_template.jinja`` (and ``additional_chat_templates/*.jinja``), else
  ``tokenizer_config.json``'s ``chat_template`` (one template, or a list of named ones: a
  request with tools uses ``tool_use`` when there is one, otherwise ``default``), rendered as
  transformers' ``apply_chat_template`` renders it: Jinja2's immutable sandbox with
  ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and the
  ``{% generation %}`` tag, a ``tojson`` filter that does not escape HTML, the
  ``raise_exception`` and ``strftime_now`` globals, the special tokens (``bos_token``,
  ``eos_token``, ... from ``tokenizer_config.json`` or ``special_tokens_map.json``) and the
  request's ``chat_template_kwargs`` as variables; the rendered text is encoded without
  adding special tokens (the template writes them), as ``apply_chat_template(tokenize=True)``
  and the engines do.

A rendered chat is encoded piece by piece: the tokenizer splits its input at the added tokens
(``<|im_start|>``, ``<|eot_id|>``, ...) before anything else and encodes each piece between
them on its own, so the ids of a conversation are the ids of its pieces, and the pieces of the
earlier turns (system prompt, past messages) are taken from a cache (``SegmentCache``, LRU,
bounded in tokens) instead of being encoded again at every turn. The split is exact only for
added tokens that strip no whitespace around them: the cache checks itself at load time on
texts built from every added token, and encodes whole texts when the tokenizer does not
split that way.

Before rendering, messages are prepared as vLLM and SGLang prepare an OpenAI request's:
``content: null`` becomes ``""``; an assistant's ``tool_calls[].function.arguments`` given as
a JSON string becomes the object it encodes; a list of content parts is kept as parts
(``{"type": "text", "text": ...}``, an image, audio or video part as ``{"type": "image"}``
and so on) for a template that iterates over ``message.content`` (``"openai"`` format), or
joined into one string for a template that does not (``"string"`` format: text parts joined
by a newline, as vLLM does, or by a space, as SGLang does: ``engine=``).

``tokenizers`` and ``jinja2`` are imported when a tokenizer is made (``radixcache[epp]``).
"""

from __future__ import annotations

import json
import os
import re
from array import array
from collections import OrderedDict
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional, Sequence

__all__ = ["CONTENT_FORMATS", "ENGINES", "ChatTokenizer", "SegmentCache", "TemplateError"]

#: Engines whose preparation of a chat request ``ChatTokenizer`` follows (``engine=``): how a
#: list of text parts becomes one string for a ``"string"``-format template.
ENGINES = {"vllm": "\n", "sglang": " "}
#: How content parts reach the template: ``"auto"`` (detected from the template, as the
#: engines do), ``"openai"`` (a list of parts) or ``"string"`` (one string).
CONTENT_FORMATS = ("auto", "openai", "string")

#: The special tokens a chat template sees by name (transformers' named special tokens).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
#: Content part types that stand for media: a template sees each as ``{"type": kind}``.
_MEDIA_PARTS = {"image_url": "image", "input_image": "image", "image": "image",
                "video_url": "video", "video": "video", "audio_url": "audio",
                "input_audio": "audio", "audio": "audio"}
_TEXT_PARTS = ("text", "input_text")
#: What ``getattr`` finds on a plain dict (its type's attributes: a dict has no others).
_DICT_ATTRIBUTES = frozenset(dir(dict))


class TemplateError(ValueError):
    """A chat request the model's template refuses (``raise_exception`` in the template, or
    a message it cannot render): the client's error, answered with 400."""


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ModuleNotFoundError as exc:  # pragma: no cover - the extra is missing
        raise ModuleNotFoundError(
            "chat templates need jinja2: pip install 'radixcache[epp]'", name=exc.name
        ) from exc
    return jinja2


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """The template compiled in transformers' environment (cached per template text)."""
    jinja2 = _jinja()

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: its body, as if the tags were not
        there (transformers uses them to mark assistant tokens; the text is the same)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own filter escapes HTML characters; templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class Environment(jinja2.sandbox.ImmutableSandboxedEnvironment):
        """transformers' sandbox, with ``message.role`` on a plain dict looked up at once."""

        def getattr(self, obj: Any, attribute: str) -> Any:
            # The sandbox tries the attribute first and falls back to the item on
            # AttributeError: a raised exception per ``message.content``, most of a chat's
            # render time. A plain dict has no attribute outside dir(dict), so its item is
            # what the sandbox would return, without the exception.
            if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
                try:
                    return obj[attribute]
                except KeyError:
                    return self.undefined(obj=obj, name=attribute)
            return super().getattr(obj, attribute)

    env = Environment(trim_blocks=True, lstrip_blocks=True,
                      extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


@lru_cache(maxsize=16)
def _content_format(template: str) -> str:
    """``"openai"`` if the template loops over a message's content (parts), else
    ``"string"``: the engines' detection (a loop over ``message.content``, ``msg.content`` or
    ``m.content``, any filter or slice on it included)."""
    jinja2 = _jinja()
    try:
        tree = _compile(template).environment.parse(template)
    except jinja2.exceptions.TemplateError:
        return "string"

    def reads_content(node: Any) -> bool:
        while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
                isinstance(node, jinja2.nodes.Getitem)
                and isinstance(node.arg, jinja2.nodes.Slice)):
            node = node.node
        if isinstance(node, jinja2.nodes.Getattr):
            owner, key = node.node, node.attr
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
            owner, key = node.node, node.arg.value
        else:
            return False
        return (key == "content" and isinstance(owner, jinja2.nodes.Name)
                and owner.name in ("message", "msg", "m"))

    return "openai" if any(reads_content(loop.iter)
                           for loop in tree.find_all(jinja2.nodes.For)) else "string"


def _token_text(value: Any) -> Optional[str]:
    """A special token of a config: a str, or an AddedToken's ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


class ChatTokenizer:
    """A model's tokenizer and chat template; see the module docstring.

    Args:
        tokenizer: A ``tokenizers.Tokenizer``.
        chat_template: The template: a str, a dict of named templates, or None (no chat).
        special_tokens: The named special tokens the template sees (``bos_token``, ...).
        engine: Whose preparation of chat messages to follow: ``"vllm"`` or ``"sglang"``.
        content_format: ``"auto"``, ``"openai"`` or ``"string"`` (see ``CONTENT_FORMATS``).

    Raises:
        ValueError: an unknown ``engine`` or ``content_format``.
    """

    def __init__(self, tokenizer: Any, chat_template: Any = None,
                 special_tokens: Optional[dict] = None, *, engine: str = "vllm",
                 content_format: str = "auto") -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"unknown content format {content_format!r}; valid: "
                             f"{', '.join(CONTENT_FORMATS)}")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.engine = engine
        self.content_format = content_format
        #: The pieces' cache, or None when the tokenizer does not encode pieces on their own
        self.segments: Optional[SegmentCache] = SegmentCache.for_tokenizer(tokenizer)

    @classmethod
    def from_dir(cls, path: str, *, engine: str = "vllm",
                 content_format: str = "auto") -> "ChatTokenizer":
        """Load ``tokenizer.json`` and the chat template of a Hugging Face model directory.

        Args:
            path: The directory.
            engine: See the class.
            content_format: See the class.

        Returns:
            The ``ChatTokenizer``.

        Raises:
            FileNotFoundError: no ``tokenizer.json`` in ``path``.
            ValueError: a config file that is not a JSON object, or a bad option.
            ModuleNotFoundError: ``tokenizers`` or ``jinja2`` is not installed.
        """
        try:
            from tokenizers import Tokenizer
        except ModuleNotFoundError as exc:  # pragma: no cover - the extra is missing
            raise ModuleNotFoundError(
                "the picker's tokenizer needs the tokenizers library: pip install "
                "'radixcache[epp]'", name=exc.name) from exc
        _jinja()  # fail here, not at the first chat request
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"no tokenizer.json in {path!r}")
        tokenizer = Tokenizer.from_file(tokenizer_file)
        config_file = os.path.join(path, "tokenizer_config.json")
        config = _read_json(config_file) if os.path.isfile(config_file) else {}
        special = {}
        map_file = os.path.join(path, "special_tokens_map.json")
        legacy = _read_json(map_file) if os.path.isfile(map_file) else {}
        for name in SPECIAL_TOKEN_NAMES:
            value = _token_text(config.get(name))
            if value is None:
                value = _token_text(legacy.get(name))
            if value is not None:
                special[name] = value
        chat = cls(tokenizer, _read_templates(path, config), special, engine=engine,
                   content_format=content_format)
        chat._compile_templates()
        return chat

    def _compile_templates(self) -> None:
        """Compile the templates (and detect their content format) now, not on the first
        request; a template that does not compile is reported per request, as before."""
        jinja2 = _jinja()
        templates = self.chat_template
        for template in templates.values() if isinstance(templates, dict) else [templates]:
            if isinstance(template, str):
                try:
                    _compile(template)
                except jinja2.exceptions.TemplateError:
                    continue
                _content_format(template)

    # -- encoding ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        """The token ids of ``text``, as ``tokenizer(text)["input_ids"]`` gives them.

        Args:
            text: The text.
            add_special_tokens: Whether the post-processor adds its special tokens (a
                completion's prompt: yes; a rendered chat: no).

        Returns:
            A list of ints.
        """
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def template_for(self, tools: Any = None) -> str:
        """The template a request uses: with several named ones, ``tool_use`` for a request
        with tools when there is one, else ``default``.

        Raises:
            TemplateError: the model has no chat template, or none to choose.
        """
        template = self.chat_template
        if isinstance(template, dict):
            if tools is not None and "tool_use" in template:
                return template["tool_use"]
            if "default" in template:
                return template["default"]
            raise TemplateError(f"the model has several chat templates and no default: "
                                f"{', '.join(sorted(template))}")
        if template is None:
            raise TemplateError("the model has no chat template: send /v1/completions")
        return template

    def render(self, messages: Sequence[Any], tools: Any = None, *,
               add_generation_prompt: bool = True, documents: Any = None,
               template_kwargs: Optional[dict] = None) -> str:
        """Render a conversation with the model's chat template, as transformers does.

        The messages are rendered as given (``prepare_messages`` turns an OpenAI request's
        into what the engines render).

        Args:
            messages: The conversation: dicts with ``role`` and ``content``.
            tools: The tools (JSON schemas), or None.
            add_generation_prompt: Whether to open the assistant's turn.
            documents: Documents for templates that read them, or None.
            template_kwargs: More variables for the template (they override the special
                tokens of the same name).

        Returns:
            The prompt text.

        Raises:
            TemplateError: the template refused the conversation, or there is no template.
        """
        jinja2 = _jinja()
        template = self.template_for(tools)
        variables = dict(self.special_tokens)
        if template_kwargs:
            variables.update(template_kwargs)
        try:
            return _compile(template).render(messages=messages, tools=tools,
                                             documents=documents,
                                             add_generation_prompt=add_generation_prompt,
                                             **variables)
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"the chat template refused the request: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise TemplateError(f"the chat template cannot render the request: "
                                f"{type(exc).__name__}: {exc}") from exc

    def prepare_messages(self, messages: Sequence[Any], tools: Any = None) -> list:
        """An OpenAI request's messages as the engines hand them to the template (see the
        module docstring).

        Args:
            messages: The request's ``messages``.
            tools: The request's ``tools`` (they choose the template whose content format
                counts).

        Returns:
            New message dicts (the given ones are not changed).

        Raises:
            TemplateError: a message that is not an object, or tool-call arguments that are
                not valid JSON.
        """
        content_format = self.content_format
        if content_format == "auto":
            try:
                content_format = _content_format(self.template_for(tools))
            except TemplateError:
                content_format = "string"
        join = ENGINES[self.engine]
        prepared = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise TemplateError(f"messages[{index}] must be an object, got "
                                    f"{type(message).__name__}")
            message = dict(message)
            content = message.get("content")
            if content is None:
                message["content"] = ""
            elif isinstance(content, list):
                message["content"] = _parts(content, content_format, join)
            calls = message.get("tool_calls")
            if message.get("role") == "assistant" and isinstance(calls, list):
                message["tool_calls"] = [_parsed_call(call, index) for call in calls]
            prepared.append(message)
        return prepared

    def chat_ids(self, messages: Sequence[Any], tools: Any = None, *,
                 add_generation_prompt: bool = True, documents: Any = None,
                 template_kwargs: Optional[dict] = None) -> list:
        """The token ids of a rendered conversation: ``render`` then ``encode`` without
        special tokens (what ``apply_chat_template(..., tokenize=True)`` returns).

        Raises:
            TemplateError: as ``render``.
        """
        text = self.render(messages, tools, add_generation_prompt=add_generation_prompt,
                           documents=documents, template_kwargs=template_kwargs)
        if self.segments is not None:
            return self.segments.encode(text)
        return self.encode(text, add_special_tokens=False)


class SegmentCache:
    """A text's ids as the ids of its pieces between added tokens, the pieces cached (LRU).

    ``SegmentCache.for_tokenizer(tokenizer)`` makes one only when that is exact for the
    tokenizer: its added tokens strip no whitespace and match whole (no ``lstrip``,
    ``rstrip``, ``single_word``, nor ``normalized`` under a normalizer), and a self-check on
    texts built from each added token gives the ids a whole encode gives. Otherwise it
    returns None.

    Args:
        tokenizer: A ``tokenizers.Tokenizer``.
        max_tokens: The most token ids the cache keeps (4 bytes each, plus the pieces' text).
    """

    def __init__(self, tokenizer: Any, max_tokens: int = 1 << 22) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self._ids = {token.content: token_id for token_id, token
                     in tokenizer.get_added_tokens_decoder().items()}
        # Longest first: a regex alternation takes the first that matches, and the
        # tokenizer takes the longest added token at the leftmost position.
        names = sorted(self._ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names \
            else None
        self._pieces: OrderedDict = OrderedDict()  # piece -> array of its ids
        self._tokens = 0
        self.hits = self.misses = 0

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, max_tokens: int = 1 << 22) -> Optional["SegmentCache"]:
        """A cache for ``tokenizer``, or None when piecewise encoding is not exact for it."""
        added = tokenizer.get_added_tokens_decoder().values()
        if not added:
            return None
        has_normalizer = tokenizer.normalizer is not None
        if any(token.lstrip or token.rstrip or token.single_word or
               (token.normalized and has_normalizer) for token in added):
            return None
        cache = cls(tokenizer, max_tokens)
        return cache if cache._agrees() else None

    def _agrees(self) -> bool:
        """Whether pieces give the whole encode's ids on texts around every added token."""
        samples = []
        for name in self._ids:
            samples += [f"{name}", f"a {name} b", f" {name}\n\n", f"x{name}y  {name}",
                        f"\n{name}{name} hello, world!\n", f"é ü {name} 12 345  ",
                        f"  lead {name}\ttab\r\n"]
        samples.append("".join(self._ids) + " tail")
        for text in samples:
            whole = self.tokenizer.encode(text, add_special_tokens=False).ids
            self._pieces.clear()
            self._tokens = 0
            if self.encode(text) != whole:
                return False
        self._pieces.clear()
        self._tokens = 0
        self.hits = self.misses = 0
        return True

    def encode(self, text: str) -> list:
        """The ids of ``text`` without special tokens added (``encode(text,
        add_special_tokens=False)``), from the cached pieces."""
        parts = self._split.split(text)  # text, added token, text, ..., text
        pieces = self._pieces
        texts = [part for part in parts[0::2] if part]
        missing = list(dict.fromkeys(part for part in texts if part not in pieces))
        if missing:
            self.misses += len(missing)
            # One piece (a follow-up's new message) is encoded here: a batch of one would
            # hand it to the tokenizer's thread pool and back.
            encoded = ([self.tokenizer.encode(missing[0], add_special_tokens=False)]
                       if len(missing) == 1
                       else self.tokenizer.encode_batch(missing, add_special_tokens=False))
            for part, encoding in zip(missing, encoded):
                ids = array("i", encoding.ids)
                pieces[part] = ids
                self._tokens += len(ids)
        ids: list = []
        added = self._ids
        touch = pieces.move_to_end
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(added[part])
            elif part:
                ids += pieces[part].tolist()  # in C, where extend() iterates in Python
                touch(part)
        self.hits += len(texts) - len(missing)
        while self._tokens > self.max_tokens and len(pieces) > 1:
            _, dropped = pieces.popitem(last=False)
            self._tokens -= len(dropped)
        return ids


def _parts(content: list, content_format: str, join: str) -> Any:
    """A list of content parts as the template gets it (see the module docstring)."""
    if content_format == "openai":
        parts = []
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind in _TEXT_PARTS:
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind in _MEDIA_PARTS:
                parts.append({"type": _MEDIA_PARTS[kind]})
        return parts
    texts = [part.get("text", "") for part in content
             if isinstance(part, dict) and part.get("type") in _TEXT_PARTS]
    return join.join(texts)


def _parsed_call(call: Any, index: int) -> Any:
    """A tool call whose ``function.arguments`` JSON string is decoded (what templates
    expect)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        decoded = json.loads(arguments)
    except ValueError as exc:
        raise TemplateError(f"messages[{index}]: tool call arguments are not valid JSON: "
                            f"{exc}") from exc
    return dict(call, function=dict(call["function"], arguments=decoded))


def _read_templates(path: str, config: dict) -> Any:
    """The chat template(s) of a model directory, as transformers finds them: the
    ``.jinja`` files first, then ``tokenizer_config.json``'s ``chat_template``."""
    templates = {}
    main = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(main):
        with open(main, encoding="utf-8") as handle:
            templates["default"] = handle.read()
    extra = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra, name), encoding="utf-8") as handle:
                    templates[name[: -len(".jinja")]] = handle.read()
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template
                if isinstance(entry, dict) and "name" in entry and "template" in entry}
    return template if isinstance(template, str) else None
