"""Structured output through xgrammar (the grammar engine vLLM and TensorRT-LLM use): a request's StructuredOutputs
is compiled once for the checkpoint's vocabulary; each sequence gets a Matcher that accepts its committed tokens and
fills the token bitmask its next sampling step is masked with.

JSON (a schema, or any object) is compiled without free whitespace: separators are ", " and ": " and nothing else,
so a model that likes spaces (a random-weight one, above all) cannot spend max_tokens on them; the output is what
json.dumps writes, valid JSON either way.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import xgrammar as xgr

from engine.core.structured import StructuredOutputs
from engine.tokenizer import Tokenizer


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_ids: list[int]) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and its stop token taken: nothing more may follow."""
        return self.matcher.is_terminated()

    def fill(self, bitmask, row: int) -> None:
        """Row `row` of a [rows, ceil(vocab / 32)] int32 bitmask (xgrammar's layout): the tokens allowed next."""
        if not self.done:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def legal(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar takes from here; the matcher is left as it was."""
        n = 0
        while n < len(tokens) and not self.done and self.matcher.accept_token(tokens[n]):
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def ahead(self, tokens: list[int]) -> "Ahead":
        return Ahead(self, tuple(tokens))


@dataclass(slots=True)
class Ahead:
    """A matcher as it will be once `tokens` (drafts it takes: `legal`) follow its committed tokens: what a
    speculative verify row past those drafts is masked with. Filled at sampling time, then rolled back."""
    base: Matcher
    tokens: tuple[int, ...]

    def fill(self, bitmask, row: int) -> None:
        for token in self.tokens:
            self.base.matcher.accept_token(token)
        try:
            self.base.fill(bitmask, row)
        finally:
            self.base.matcher.rollback(len(self.tokens))


class Grammars:
    """Compiles StructuredOutputs for one checkpoint (xgrammar caches what it compiled)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        vocab = [""] * vocab_size        # ids past the tokenizer's (the embedding's padding) stay empty: never allowed
        for token, i in tokenizer.tok.get_vocab(with_added_tokens=True).items():
            if i < vocab_size:
                vocab[i] = token
        info = xgr.TokenizerInfo(vocab, _vocab_type(tokenizer), vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.compiler = xgr.GrammarCompiler(info)
        self.stop_ids = list(stop_ids)

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        """Raises ValueError naming the field (e.g. `response_format` or `structured_outputs.regex`) and why."""
        if not self.stop_ids:
            raise ValueError("structured_outputs: this model names no end-of-sequence token (config, generation "
                             "config or tokenizer) for a grammar to end with")
        try:
            match spec.kind:
                case "json":
                    return self.compiler.compile_grammar(_json_grammar(spec.json))
                case "json_object":
                    return self.compiler.compile_grammar(_json_grammar('{"type": "object"}'))
                case "regex":
                    return self.compiler.compile_regex(spec.regex)
                case "choice":
                    alternatives = " | ".join(json.dumps(c) for c in spec.choice)
                    return self.compiler.compile_grammar(f"root ::= {alternatives}")
                case "grammar":
                    return self.compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as e:
            reason = str(e).strip().splitlines()[-1]
            raise ValueError(f"{spec.field}: invalid {spec.kind.replace('_', ' ')} ({_tail(reason)})") from None
        raise AssertionError(spec.kind)

    def matcher(self, compiled: xgr.CompiledGrammar) -> Matcher:
        return Matcher(compiled, self.stop_ids)


# xgrammar 0.2.8 spells the characters of a length-bounded string ("maxLength") as anything but a quote, a backslash,
# CR or LF: other control characters (which JSON requires escaped, and json.loads refuses raw) get through. Its
# unbounded strings already exclude \0-\x1f; bounded ones are given the same class.
_LOOSE_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_CHAR = '[^\\0-\\x1f\\"\\\\]'


def _json_grammar(schema: str) -> str:
    """The EBNF of a JSON schema, compact (no free whitespace), strings strictly JSON."""
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return ebnf.replace(_LOOSE_CHAR, _JSON_CHAR)


def tool_calls(parser: str, tools: list[tuple[str, dict]], parallel: bool) -> str:
    """The EBNF of tool_choice "auto": free text, and every call opened in the parser's format held to one of the
    tools (its name, then arguments by its parameters' schema; compact JSON as above). Hermes' and Mistral's calls
    open with a tag anywhere in the text (xgrammar's TagDispatch); Llama's answer is either calls or text."""
    def lit(text: str) -> xgr.Grammar:
        return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))

    key = "parameters" if parser == "llama3_json" else "arguments"
    one = xgr.Grammar.union(*[xgr.Grammar.concat(
        lit(f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{key}": '),
        xgr.Grammar.from_ebnf(_json_grammar(json.dumps(schema))), lit("}")) for name, schema in tools])
    if parser == "hermes":
        group = xgr.Grammar.concat(lit("\n"), one, lit("\n</tool_call>"))
        return _dispatch("<tool_call>", group, parallel)
    sep = "; " if parser == "llama3_json" else ", "
    group = xgr.Grammar.from_ebnf(f"root ::= call ({json.dumps(sep)} call)*\n{_renamed(str(one), 'call')}") \
        if parallel else one
    if parser == "llama3_json":
        return f'root ::= calls | "" | [^{{] [^]*\n{_renamed(str(group), "calls")}'
    return _dispatch("[TOOL_CALLS]", xgr.Grammar.concat(lit(" ["), group, lit("]")), parallel)


def _dispatch(trigger: str, group: xgr.Grammar, parallel: bool) -> str:
    loop = "true" if parallel else "false"
    return (f"{_renamed(str(group), 'call_group')}root ::= TagDispatch(({json.dumps(trigger)}, call_group), "
            f"loop_after_dispatch={loop}, excludes=())\n")


_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|.', re.S)


def _renamed(ebnf: str, name: str) -> str:
    """A grammar's text with its rule `root` called `name` (literals and character classes left alone)."""
    return "".join(name if t == "root" else t for t in _TOKENS.findall(ebnf))


def _vocab_type(tokenizer: Tokenizer) -> xgr.VocabType:
    """How the vocabulary spells bytes: GPT-2's byte-level alphabet (Qwen), SentencePiece's <0xNN> fallback, or raw."""
    decoder = json.loads(tokenizer.tok.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL
    return xgr.VocabType.BYTE_FALLBACK if "ByteFallback" in kinds else xgr.VocabType.RAW


def _tail(reason: str) -> str:
    """xgrammar's message without its source location ("[time] file.cc:123: ")."""
    return reason.split(": ", 1)[1] if reason.startswith("[") and ": " in reason else reason
