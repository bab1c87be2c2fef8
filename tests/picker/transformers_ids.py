"""Token ids from transformers' own tokenizer, in a process where torch cannot be imported.

Reads a JSON job on stdin: ``{"model_dir": ..., "chats": [{"messages", "tools",
"add_generation_prompt", "kwargs"}], "prompts": [...]}``; writes ``{"chats": [ids or
{"error": ...}], "prompts": [ids], "torch": false, "version": ...}``: what
``AutoTokenizer.from_pretrained(model_dir).apply_chat_template(..., tokenize=True)`` and
``tokenizer(prompt)["input_ids"]`` give.
"""

import json
import sys

sys.modules["torch"] = None  # transformers must not need it: `import torch` now fails

import transformers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

job = json.load(sys.stdin)
tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
chats = []
for chat in job["chats"]:
    try:
        ids = tokenizer.apply_chat_template(
            chat["messages"], tools=chat.get("tools"), tokenize=True, return_dict=False,
            add_generation_prompt=chat.get("add_generation_prompt", True),
            **chat.get("kwargs", {}))
        chats.append(list(ids))
    except Exception as exc:  # the template refused it: the test expects the same refusal
        chats.append({"error": f"{type(exc).__name__}: {exc}"})
prompts = [tokenizer(prompt)["input_ids"] for prompt in job["prompts"]]
print(json.dumps({"chats": chats, "prompts": prompts, "version": transformers.__version__,
                  "torch": any(name == "torch" and module is not None
                               for name, module in sys.modules.items())}))
