"""tokenizers-backed encode, incremental UTF-8-safe detokenize, and the checkpoint's chat template."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        """From a Hugging Face directory's tokenizer.json and tokenizer_config.json, or a .gguf file's metadata."""
        model_dir = Path(model_dir)
        if model_dir.suffix == ".gguf":
            from engine.models import gguf_file
            self.tok, config = gguf_file.tokenizer(model_dir)
        else:
            self.tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
            config_file = model_dir / "tokenizer_config.json"
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
        self.chat_template: str | None = config.get("chat_template")
        # what a template may print (Llama 3's starts with {{ bos_token }}), as transformers passes them
        self.specials = {name: value.get("content") if isinstance(value, dict) else value
                         for name in ("bos_token", "eos_token", "pad_token", "unk_token")
                         if (value := config.get(name)) is not None}
        self.vocab_size = self.tok.get_vocab_size()
        self.texts: dict[int, str] = {}

    def stop_ids(self, model_eos: list[int]) -> list[int]:
        """The checkpoint's EOS ids and the tokenizer's eos_token, as vLLM stops on both."""
        eos = self.specials.get("eos_token")
        found = None if eos is None else self.tok.token_to_id(eos)
        return list(model_eos) + ([found] if found is not None and found not in model_eos else [])

    def encode(self, text: str) -> list[int]:
        """The text's tokens alone (a chat template's output, which holds its own BOS; stop and bad words)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt's tokens with what the tokenizer's post-processor adds (Llama 3's, Mistral's and Gemma's
        BOS; nothing for Qwen), as Hugging Face and vLLM encode a completion prompt."""
        return self.tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included (logprobs' decoded_token); each is decoded once."""
        text = self.texts.get(token)
        if text is None:
            text = self.texts[token] = self.tok.decode([token], skip_special_tokens=False)
        return text

    def layout(self) -> tuple[dict[int, str], frozenset[int]]:
        """The tokens of spaces and tabs alone (indentation), each as the text encodes to it (a text some other token
        also decodes to, such as a byte-fallback token, is left out), and the tokens that end a line."""
        texts = self.tok.decode_batch([[t] for t in range(self.vocab_size)], skip_special_tokens=False)
        blanks = {t: text for t, text in enumerate(texts) if text and not text.strip(" \t")}
        breaks = frozenset(t for t, text in enumerate(texts) if text.endswith("\n"))
        return {t: text for t, text in blanks.items() if self.encode(text) == [t]}, breaks

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """As transformers renders it: its Jinja environment (loop controls, a tojson that keeps key order and
        non-ASCII text), `tools` and a request's chat_template_kwargs (Qwen3's enable_thinking) passed through."""
        if not self.chat_template:
            raise ValueError("messages: this model's tokenizer_config.json has no chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message: str) -> None:
            raise ValueError(f"messages: {message}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = tojson
        template = env.from_string(self.chat_template)
        values = {**self.specials, **kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt}
        if tools:
            values["tools"] = tools
        return template.render(**values)

    def detokenizer(self, skip_special_tokens: bool = True) -> "Detokenizer":
        return Detokenizer(self, skip_special_tokens)


class Detokenizer:
    """Emits text only once its bytes form complete UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0   # start of the window decoded for context
        self.read = 0     # end of the ids whose text was emitted

    def add(self, token: int) -> str:
        self.ids.append(token)
        before, after = self._window()
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end of a sequence, replacement characters included."""
        before, after = self._window()
        self.prefix = self.read = len(self.ids)
        return after[len(before):]

    def _window(self) -> tuple[str, str]:
        """The text of the context window without and with the ids not yet emitted."""
        decode = self.tokenizer.decode
        return (decode(self.ids[self.prefix:self.read], self.skip), decode(self.ids[self.prefix:], self.skip))
