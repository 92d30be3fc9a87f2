"""The ModelRunner protocol and the Row a runner computes: plain data handed over by the core."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from engine.core.sampling import SamplingParams
from engine.kv.layout import Layout
from engine.models.config import ModelConfig


@dataclass(slots=True)
class Row:
    seq: int                      # request id: keys the per-request sampler state
    start: int                    # position of the first input token
    tokens: list[int]             # host input tokens; empty when the input is the previous step's sample
    prev: int = -1                # index of this row's input in the previous step's sampled tokens
    slots: list[int] = field(default_factory=list)        # paged: flat cache slots of the new positions
    block_table: list[int] = field(default_factory=list)  # paged: the sequence's blocks
    groups: list[tuple[list[int], list[int]]] = field(default_factory=list)   # paged: (slots, block_table) of
    # each layer group past the first, for a model with sliding-window layers (engine/kv/layout.py)
    buf: int = -1                 # dense: the sequence's buffer
    sample: bool = True
    params: SamplingParams | None = None
    ban: tuple[int, ...] = ()     # token ids masked out (min_tokens not reached)
    fed_output: bool = False      # decode: the input token is the previous output, for the penalties' counts
    prompt: list[int] | None = None   # the request's prompt, when its repetition penalty needs it
    grammar: Any = None           # structured output: the sequence's Matcher (engine/grammar.py), read at `sample`
    ban_later: Callable[[], list[int]] | None = None      # more token ids to mask, asked for at `sample` (bad words)
    prompt_logprobs: int | None = None    # prefill: each position's logprob of the token after it, and the top k
    next_token: int = -1          # prefill: the prompt token after the row's last position (-1: none, or output)
    drafts: tuple[int, ...] = ()  # verify: the draft tokens before this row's position, counted by its penalties
    counted: tuple[int, ...] = () # output tokens that join the penalties' counts with this row (accepted drafts)

    @property
    def deferred(self) -> bool:
        """Its mask depends on the output committed when it samples: sampling waits for this tick's commits."""
        return self.grammar is not None or self.ban_later is not None

    @property
    def length(self) -> int:
        return len(self.tokens) or 1

    def kv(self, group: int) -> tuple[list[int], list[int]]:
        """(slots, block table) of a layer group."""
        return (self.slots, self.block_table) if group == 0 else self.groups[group - 1]


@dataclass(slots=True)
class TokenLogprobs:
    """One sampled position: the sampled token's logprob and rank (1 = the most likely), and the top tokens as
    (id, logprob), most likely first."""
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class Sampled:
    """A step's results, read back: one token per row (-1 where a row did not sample) and, when any row asked
    for them, each row's logprobs (None for rows that did not ask)."""
    tokens: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None    # by row: one per prompt token predicted


@dataclass(slots=True)
class PickedLogprobs:
    """A step's logprobs as the runner's arrays (torch tensors, MLX arrays), still on the device."""
    rows: list[int]               # the step's rows that asked, in order
    ks: list[int]                 # how many top tokens each asked for
    values: Any                   # [n, 1 + k] fp32: the sampled token's logprob, then the top k
    ids: Any                      # [n, 1 + k] ints: the sampled token's rank, then the top k ids

    def remap(self, rows: list[int]) -> PickedLogprobs:
        """The same results for a step whose sampled rows were rows[0], rows[1], ... of a larger step."""
        return replace(self, rows=[rows[i] for i in self.rows])

    def read(self, n_rows: int) -> list[TokenLogprobs | None]:
        """Per row of the step (None for rows that did not ask); waits for the device."""
        out: list[TokenLogprobs | None] = [None] * n_rows
        for row, k, v, i in zip(self.rows, self.ks, self.values.tolist(), self.ids.tolist()):
            out[row] = TokenLogprobs(v[0], i[0], list(zip(i[1:1 + k], v[1:1 + k])))
        return out


def logprob_rows(rows: list[Row]) -> list[int]:
    """The rows whose requests asked for logprobs."""
    return [i for i, r in enumerate(rows) if r.params is not None and r.params.logprobs is not None]


class ModelRunner(Protocol):
    vocab_size: int
    max_model_len: int            # the checkpoint's, until the engine lowers it to its max_model_len
    eos_token_ids: list[int]
    bytes_per_token: int          # KV bytes of one position, all layers
    windows: list[int]            # per layer: its sliding window (0: none)
    tokens_computed: int          # positions run through the model, prefill and decode
    step_rows: int                # the most decode rows a step runs in one pass (verify steps' cap)
    cheap_rows: int               # how many of them a step takes at little more than one row's cost
    overlaps: bool                # a step runs while the host works (launched steps queue on a device)

    def init_paged(self, num_blocks: int, block_size: int, layout: Layout | None = None) -> None:
        """A pool of num_blocks blocks, each `layout.width` layers' pages (None: one group of every layer)."""
    def kv_budget(self, utilization: float, prefill_tokens: int) -> int | None:
        """Bytes the KV pool may take when the engine holds `utilization` of the device's memory: what the loaded
        weights and a prefill step of `prefill_tokens` leave. None where memory is not the device's own (a CPU)."""
    def forward(self, rows: list[Row], prev: Any | None) -> Any:
        """Launch one step's model pass (`prev`: the step whose sampled tokens feed it, on the device); returns its
        handle. `sample` must follow before the step is fetched or fed to another."""
    def sample(self, handle: Any) -> None:
        """Launch the step's sampling. Apart from `forward` so a grammar's mask can be filled from tokens that were
        read back while the model pass ran."""
    def fetch(self, handle: Any) -> Sampled:
        """Read a step's sampled tokens and the logprobs its rows asked for."""
    def row_costs(self) -> tuple[float, float, float] | None:
        """What a decode row adds to a one-row step, within the cheap rows and past them, and what its draw adds at
        a temperature, timed on this machine; None: not timed (speculation then prices rows by its defaults)."""
    def release(self, seq: int) -> None: ...
    def check(self, params: SamplingParams) -> None:
        """Raise ValueError naming the field when this runner cannot honour one of `params`."""
    def dense_alloc(self, capacity: int) -> int: ...
    def dense_resize(self, buf: int, capacity: int) -> None: ...
    def dense_free(self, buf: int) -> None: ...
    def dense_copy(self, src: int, dst: int, positions: int) -> None:
        """Copy a dense buffer's first `positions` positions into another (a forked sequence's own KV)."""
    def copy_block(self, src: int, dst: int) -> None:
        """Copy one KV block, every page (copy-on-write of a forked sequence's shared tail)."""


@dataclass(slots=True)
class Geometry:
    """What the core needs to know of a loaded model, whatever the framework."""
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    layers: int
    kv_shape: tuple[int, int]     # (n_kv_heads, head_dim)
    bytes_per_token: int          # KV bytes of one position, all layers
    scale: float                  # attention softmax scale
    windows: list[int]            # per layer: positions a query sees, itself included; 0: all

    @classmethod
    def of(cls, cfg: ModelConfig, itemsize: int) -> "Geometry":
        n_kv, hd = cfg.num_key_value_heads, cfg.head_dim
        return cls(cfg.vocab_size, cfg.max_position_embeddings, list(cfg.eos_token_id), cfg.num_hidden_layers,
                   (n_kv, hd), 2 * cfg.num_hidden_layers * n_kv * hd * itemsize, cfg.attn_scale, cfg.windows)


def spans(rows: list[Row]) -> list[tuple[int, int, int]]:
    """(offset in the flattened tokens, length, start position) of each row."""
    out, offset = [], 0
    for r in rows:
        out.append((offset, r.length, r.start))
        offset += r.length
    return out


def in_order(chained: list[tuple[int, int]], n: int) -> bool:
    """Whether all `n` flat inputs are the previous step's tokens, row i taking row i's (steady decode)."""
    return len(chained) == n and all(src == i for i, (_, src) in enumerate(chained))


def flatten(rows: list[Row]) -> tuple[list[int], list[int], list[tuple[int, int]], list[int]]:
    """One step's rows as flat token ids (0 where the previous step's token goes), their positions,
    (flat index, previous-step row) pairs to fill on the device, and each row's last flat index."""
    ids: list[int] = []
    positions: list[int] = []
    chained: list[tuple[int, int]] = []
    last: list[int] = []
    for r in rows:
        if r.prev >= 0:
            chained.append((len(ids), r.prev))
        ids.extend(r.tokens or (0,))
        positions.extend(range(r.start, r.start + r.length))
        last.append(len(ids) - 1)
    return ids, positions, chained, last
