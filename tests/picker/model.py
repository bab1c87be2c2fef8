"""A small model's tokenizer directory, made at test time (no download).

``make_model_dir(path)`` trains a byte-level BPE tokenizer with the ``tokenizers`` library on
generated text and writes what a Hugging Face model directory holds for it: ``tokenizer.json``
(its post-processor adds a BOS to a single sequence, as Llama's does) and
``tokenizer_config.json`` with the special tokens and chat templates. The templates are written
here to exercise what real ones use: system prompts, tools rendered with ``tojson``, assistant
tool calls and tool results, content parts iterated over, ``raise_exception``, loop controls,
``{% generation %}``, and several named templates (``default`` and ``tool_use``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|tool|>",
           "<|image|>"]

#: A ChatML-style template over content parts (``"openai"`` content format), with tools.
PARTS_TEMPLATE = """{{ bos_token }}
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call these tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
{%- if message.role not in ['user', 'assistant', 'tool', 'system'] %}
{{ raise_exception('unknown role ' + message.role) }}
{%- endif %}
<|im_start|>{{ message.role }}
{% if message.content is string %}{{ message.content }}{% else %}
{%- for part in message.content %}
{%- if part.type == 'text' %}{{ part.text }}{% elif part.type == 'image' %}<|image|>{% endif %}
{%- endfor %}{% endif %}
{%- if message.tool_calls %}
{%- for call in message.tool_calls %}
<|tool|>{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments
| tojson }}}
{%- endfor %}
{%- endif %}
{% if message.role == 'assistant' %}{% generation %}<|im_end|>{% endgeneration %}
{%- else %}<|im_end|>{% endif %}

{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if reasoning is defined and reasoning %}<think>
{% endif %}{% endif %}"""

#: A Llama-3-style template over plain string content (``"string"`` content format), with a
#: default system prompt and tool results as ``ipython`` turns.
STRING_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = 'You are a helpful assistant.' %}
{%- endif %}
{{- '<|im_start|>system\\n' + system_message }}
{%- if tools is not none %}
    {{- '\\nTools:\\n' }}
    {%- for t in tools %}{{- t | tojson(indent=2) + '\\n' }}{%- endfor %}
{%- endif %}
{{- '<|im_end|>' }}
{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {{- '<|im_start|>ipython\\n' + message.content | string + '<|im_end|>' }}
    {%- elif message.tool_calls is defined and message.tool_calls %}
        {{- '<|im_start|>assistant\\n' }}
        {%- for call in message.tool_calls %}
            {{- '<|tool|>' + call.function.name + '(' + call.function.arguments | tojson + ')' }}
        {%- endfor %}
        {{- '<|eos|>' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have "
         "from or one had by word but not what all were we when your can said there use an "
         "each which she do how their if will up other about out many then them these so some "
         "her would make like him into time has look two more write go see number no way could "
         "people my than first water been call who oil its now find long down day did get come "
         "made may part cache prefix token router worker request model prompt reply weather "
         "city temperature tool function arguments system user assistant json value list "
         "Paris Tokyo Berlin Lima Oslo Cairo hello question answer explain summary").split()


def corpus(lines: int = 3000, seed: int = 0) -> list:
    rng = random.Random(seed)
    text = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 24))]
        if rng.random() < 0.3:
            words.append(json.dumps({"city": rng.choice(WORDS), "n": rng.randint(0, 999)}))
        text.append(" ".join(words) + rng.choice([".", "?", "!", ":\n", ",\n"]))
    return text


def make_model_dir(path: Path, *, vocab_size: int = 1500, named_templates: bool = False) -> Path:
    """Write a tokenizer directory at ``path`` (created); returns ``path``.

    ``named_templates``: the chat templates as a list of named ones (``default`` over string
    content, ``tool_use`` over parts), else one template (over parts).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    bos = tokenizer.token_to_id("<|bos|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)])
    tokenizer.save(str(path / "tokenizer.json"))
    if named_templates:
        template = [{"name": "default", "template": STRING_TEMPLATE},
                    {"name": "tool_use", "template": PARTS_TEMPLATE}]
    else:
        template = PARTS_TEMPLATE
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": {"__type": "AddedToken", "content": "<|eos|>", "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False,
                      "special": True},
        "pad_token": "<|pad|>",
        "model_max_length": 1 << 20,
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path
