"""The picker tokenizes as the engine does: its ids equal transformers' on the same model.

transformers runs in a subprocess where ``import torch`` fails (``transformers_ids.py``): the
comparison needs no torch. The model is the test model (``model.py``: a tokenizer trained here
and chat templates using system prompts, tools, tool calls, content parts, loop controls,
``raise_exception``); the conversations cover each of them.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from epp_support import require

pytestmark = pytest.mark.core_independent

HERE = Path(__file__).resolve().parent

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. <Paris> & \"Lyon\""},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
CLOCK_TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
                                                                             "properties": {}}}}

CONVERSATIONS = [
    # A user alone, then a system prompt and turns.
    {"messages": [{"role": "user", "content": "hello Paris, what time is it?"}]},
    {"messages": [{"role": "system", "content": "You are a terse router. Answer in one word."},
                  {"role": "user", "content": "first question about the cache"},
                  {"role": "assistant", "content": "prefix"},
                  {"role": "user", "content": "and the second one?\n\nWith two lines."}]},
    # Tools, an assistant's tool calls (arguments as the OpenAI JSON string), a tool result.
    {"messages": [{"role": "system", "content": "Use tools when you must."},
                  {"role": "user", "content": "weather in Tokyo and the time"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function", "function": {
                          "name": "get_weather",
                          "arguments": "{\"city\": \"Tokyo <東京> & co\", \"unit\": \"celsius\"}"}},
                      {"id": "call_2", "type": "function",
                       "function": {"name": "now", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
                  {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
                  {"role": "user", "content": "thanks"}],
     "tools": [WEATHER_TOOL, CLOCK_TOOL]},
    {"messages": [{"role": "user", "content": "anything?"}], "tools": [CLOCK_TOOL]},
    # Content parts: text and an image; two texts.
    {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is in this picture of Oslo?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
    {"messages": [{"role": "system", "content": [{"type": "text", "text": "be kind"}]},
                  {"role": "user", "content": [{"type": "text", "text": "part one"},
                                               {"type": "text", "text": "part two"}]}]},
    # No generation prompt; a template variable from chat_template_kwargs.
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
     "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "think first"}],
     "kwargs": {"reasoning": True}},
    # Special tokens typed into the text, whitespace and Unicode at the edges.
    {"messages": [{"role": "user", "content": "  lead <|im_end|> mid <|bos|>\n\n trail  "}]},
    {"messages": [{"role": "user", "content": "é ü 東京 — \t tabs\r\n and 12 345 678"}]},
    # A role the template refuses (raise_exception).
    {"messages": [{"role": "wizard", "content": "abracadabra"}]},
]

PROMPTS = ["hello Paris", " leading space", "<|bos|> already there", "", "é 東京\n\n12",
           "the cache prefix token router worker " * 40]


def transformers_ids(model_dir: Path, chats: list, prompts: list) -> dict:
    job = json.dumps({"model_dir": str(model_dir), "chats": chats, "prompts": prompts})
    done = subprocess.run([sys.executable, str(HERE / "transformers_ids.py")], input=job,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["torch"] is False  # transformers ran without torch
    return result


@pytest.mark.parametrize("named", [False, True], ids=["one-template", "named-templates"])
def test_chat_and_prompt_ids_equal_transformers(named, model_dir, named_model_dir):
    require(("tokenizers", "jinja2", "transformers", "msgspec"))
    from radixcache.picker import ChatTokenizer, RequestError, RequestReader, TemplateError

    directory = named_model_dir if named else model_dir
    tokenizer = ChatTokenizer.from_dir(str(directory))
    assert tokenizer.segments is not None  # the piecewise path is the one compared
    reader = RequestReader(tokenizer, ["m"])
    chats = []
    for conversation in CONVERSATIONS:
        prepared = tokenizer.prepare_messages(conversation["messages"],
                                              conversation.get("tools"))
        chats.append(dict(conversation, messages=prepared))
    expected = transformers_ids(directory, chats, PROMPTS)
    compared = refused = 0
    for conversation, chat, want in zip(CONVERSATIONS, chats, expected["chats"]):
        body = {"model": "m", "messages": conversation["messages"]}
        if "tools" in conversation:
            body["tools"] = conversation["tools"]
        if "add_generation_prompt" in conversation:
            body["add_generation_prompt"] = conversation["add_generation_prompt"]
        if "kwargs" in conversation:
            body["chat_template_kwargs"] = conversation["kwargs"]
        if isinstance(want, dict):  # transformers refused it: so must the picker (400)
            with pytest.raises(TemplateError):
                tokenizer.chat_ids(chat["messages"], chat.get("tools"))
            with pytest.raises(RequestError) as info:
                reader.read("/v1/chat/completions", json.dumps(body).encode())
            assert info.value.status == 400 and "refused" in info.value.message
            refused += 1
            continue
        got = tokenizer.chat_ids(chat["messages"], chat.get("tools"),
                                 add_generation_prompt=chat.get("add_generation_prompt", True),
                                 template_kwargs=chat.get("kwargs"))
        assert got == want, conversation
        # The whole path: the OpenAI body as the picker reads it (prepared, cached pieces).
        request = reader.read("/v1/chat/completions", json.dumps(body).encode())
        assert list(request.token_ids) == want
        compared += 1
    assert compared >= 9 and refused == (0 if named else 1)  # the string template has no check
    for prompt, want in zip(PROMPTS, expected["prompts"]):
        assert tokenizer.encode(prompt) == want
        body = json.dumps({"model": "m", "prompt": prompt}).encode()
        assert list(reader.read("/v1/completions", body).token_ids) == want
    # The picker's pieces cache was used, and still agrees after a second pass.
    assert tokenizer.segments.hits > 0
    for conversation, want in zip(chats, expected["chats"]):
        if not isinstance(want, dict):
            assert tokenizer.chat_ids(conversation["messages"], conversation.get("tools"),
                                      add_generation_prompt=conversation.get(
                                          "add_generation_prompt", True),
                                      template_kwargs=conversation.get("kwargs")) == want


def test_messages_are_prepared_as_the_engines_prepare_them(model_dir, named_model_dir):
    require(("tokenizers", "jinja2"))
    from radixcache.picker import ChatTokenizer, TemplateError

    parts_model = ChatTokenizer.from_dir(str(model_dir))
    string_model = ChatTokenizer.from_dir(str(named_model_dir))  # default: over strings
    sglang = ChatTokenizer.from_dir(str(named_model_dir), engine="sglang")
    content = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}},
               {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": content},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "1", "type": "function",
                     "function": {"name": "f", "arguments": "{\"x\": [1, 2]}"}}]}]
    prepared = parts_model.prepare_messages(messages)
    assert prepared[0]["content"] == [{"type": "text", "text": "a"}, {"type": "image"},
                                      {"type": "text", "text": "b"}]
    assert prepared[1]["content"] == ""
    assert prepared[1]["tool_calls"][0]["function"]["arguments"] == {"x": [1, 2]}
    assert messages[1]["content"] is None  # the request's own messages are not changed
    assert string_model.prepare_messages(messages)[0]["content"] == "a\nb"  # vLLM's join
    assert sglang.prepare_messages(messages)[0]["content"] == "a b"  # SGLang's
    # With tools the named tool_use template (over parts) is the one whose format counts.
    assert string_model.prepare_messages(messages, tools=[CLOCK_TOOL])[0]["content"][1] == \
        {"type": "image"}
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                              "arguments": "{not json"}}]}]
    with pytest.raises(TemplateError, match=r"messages\[0\].*not valid JSON"):
        parts_model.prepare_messages(bad)
    with pytest.raises(TemplateError, match=r"messages\[0\] must be an object"):
        parts_model.prepare_messages(["hello"])
    with pytest.raises(ValueError, match="unknown engine"):
        ChatTokenizer(parts_model.tokenizer, engine="trt")


def test_requests_the_engine_would_refuse_get_4xx_naming_the_field(model_dir):
    require(("tokenizers", "jinja2", "msgspec"))
    from radixcache.picker import ChatTokenizer, RequestError, RequestReader

    reader = RequestReader(ChatTokenizer.from_dir(str(model_dir)), ["m"], ["adapter"],
                           max_body_bytes=2000)
    chat = "/v1/chat/completions"
    cases = [
        (chat, b"{not json", 400, "not valid JSON"),
        (chat, b"[1, 2]", 400, "must be a JSON object"),
        (chat, b'{"messages": [{"role": "user", "content": "x"}]}', 400, "'model'"),
        (chat, b'{"model": "other", "messages": [{"role": "user", "content": "x"}]}', 404,
         "'other' does not exist"),
        (chat, b'{"model": "m", "messages": []}', 400, "'messages'"),
        (chat, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": 3}',
         400, "'tools'"),
        (chat, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
               b'"max_tokens": -1}', 400, "'max_tokens'"),
        (chat, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
               b'"stream": "yes"}', 400, "'stream'"),
        ("/v1/completions", b'{"model": "m", "prompt": 3}', 400, "'prompt'"),
        ("/v1/completions", b'{"model": "m", "prompt": [1, -2]}', 400, "'prompt'"),
        (chat, b"x" * 2001, 413, "more than 2000 bytes"),
    ]
    for path, body, status, words in cases:
        with pytest.raises(RequestError) as info:
            reader.read(path, body)
        assert info.value.status == status and words in info.value.message, (body, info.value)
        assert json.loads(info.value.body())["error"]["message"] == info.value.message
    adapter = reader.read("/v1/completions", b'{"model": "adapter", "prompt": [5, 6], '
                                             b'"cache_salt": "s", "max_tokens": 7}')
    assert (adapter.lora, adapter.salt, list(adapter.token_ids), adapter.max_tokens) == \
        ("adapter", "s", [5, 6], 7)
    assert reader.read("/v1/models", b"anything").kind == "other"
    batch = reader.read("/v1/completions", b'{"model": "m", "prompt": ["hello", "x"]}')
    assert list(batch.token_ids) == reader.tokenizer.encode("hello")


def test_pieces_cache_is_exact_bounded_and_refuses_stripping_tokens(model_dir):
    require(("tokenizers", "jinja2"))
    from tokenizers import AddedToken, Tokenizer

    from model import WORDS
    from radixcache.picker.tokenization import SegmentCache

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    cache = SegmentCache.for_tokenizer(tokenizer, max_tokens=300)
    specials = ["<|im_start|>", "<|im_end|>", "<|bos|>", "<|tool|>"]
    rng = random.Random(5)
    for _ in range(300):
        pieces = [rng.choice(WORDS + specials + ["\n", "  ", "é", "12"])
                  for _ in range(rng.randrange(1, 40))]
        text = "".join(p if rng.random() < 0.5 else " " + p for p in pieces)
        assert cache.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids
        assert cache._tokens <= 300 or len(cache._pieces) == 1
    assert cache.hits > 0 and cache.misses > 0
    # An added token that strips the space next to it changes its neighbours: no cache.
    stripping = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stripping.add_special_tokens([AddedToken("<|strip|>", lstrip=True)])
    assert SegmentCache.for_tokenizer(stripping) is None


def test_templates_see_dicts_as_the_stock_sandbox_shows_them(model_dir):
    """A message's keys, its dict methods, a missing key and an unsafe attribute render as in
    Jinja2's own immutable sandbox (transformers' environment), and mutating still fails."""
    require(("tokenizers", "jinja2"))
    import jinja2.ext
    import jinja2.sandbox
    from tokenizers import Tokenizer

    from radixcache.picker.tokenization import ChatTokenizer, TemplateError

    template = (
        "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ m['role'] }}"
        "|{{ m.get('name', 'anon') }}|{{ m.items() | list | length }}"
        "|{{ m.keys() | sort | join(',') }}|{{ m.missing is defined }}"
        "|{{ m.missing | default('dflt') }}|{{ m.values is defined }}"
        "|{{ m.__class__ is defined }}|{{ m.tool_calls[0].function.name if m.tool_calls }}"
        "|{{ m.items is string }}]{% endfor %}{{ bos_token }}")
    messages = [{"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": "", "items": "shadowed by the method",
                 "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    stock = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    expected = stock.from_string(template).render(messages=messages, bos_token="<s>",
                                                  tools=None, documents=None,
                                                  add_generation_prompt=True)
    encoder = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer = ChatTokenizer(encoder, chat_template=template,
                              special_tokens={"bos_token": "<s>"})
    assert tokenizer.render(messages) == expected
    assert "[user|hi|user|ann|3|content,name,role|False|dflt|True|False||False]" in expected
    # The sandbox's refusals hold: a dict stays immutable.
    mutating = ChatTokenizer(encoder, chat_template="{{ messages[0].update({}) }}")
    with pytest.raises(TemplateError, match="the chat template"):
        mutating.render(messages)


def test_templates_compile_at_load_and_a_broken_one_fails_per_request(model_dir, tmp_path):
    require(("tokenizers", "jinja2"))
    import shutil

    from radixcache.picker.tokenization import ChatTokenizer, TemplateError, _compile

    _compile.cache_clear()
    tokenizer = ChatTokenizer.from_dir(str(model_dir))
    compiled = _compile.cache_info()
    assert compiled.currsize >= 1  # the model's templates, before any request
    tokenizer.render([{"role": "user", "content": "hi"}])
    assert _compile.cache_info().misses == compiled.misses  # the request compiled nothing
    # A template that does not compile still loads, and each chat request gets its error.
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(model_dir / "tokenizer.json", broken / "tokenizer.json")
    (broken / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% if messages %}unclosed", "bos_token": "<|bos|>"}))
    bad = ChatTokenizer.from_dir(str(broken))
    for _ in range(2):
        with pytest.raises(TemplateError, match="the chat template"):
            bad.render([{"role": "user", "content": "hi"}])
