"""Torch runner: CUDA (stream-ordered steps, event-guarded copies to pinned memory) or CPU (same calls, no overlap)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine import kernels
from engine.core.sampling import SamplingParams
from engine.kernels import cpu_gemv, cpu_layers, cpu_pointwise
from engine.kv.layout import Layout
from engine.models import widen
from engine.models.loader import load_model
from engine.runners.base import Geometry, Row, Sampled, flatten, in_order, logprob_rows
from engine.runners.torch import attention as torch_attention
from engine.runners.torch import calibrate, grammar, heap, logprobs
from engine.runners.torch.graphs import GraphDecode, plain
from engine.runners.torch.host import upload
from engine.runners.torch.logprobs import DeviceLogprobs
from engine.runners.torch.penalties import Penalties
from engine.runners.torch.sampler import sample

if TYPE_CHECKING:
    from engine.runners.torch.compiled import CompiledDecode

log = logging.getLogger("pagoda")


@dataclass(slots=True)
class Step:
    rows: list[Row]
    logits: torch.Tensor | None       # of the rows that sample, until `sample` has used them
    picked: list[int] | None          # which rows those are (None: every row, one token each)
    greedy: torch.Tensor | None = None       # a graph step's argmax, the sample of its plain greedy rows
    tokens: torch.Tensor | None = None       # [rows] int64 on the device; -1 where a row did not sample
    logprobs: DeviceLogprobs | None = None   # of the rows that asked
    host: torch.Tensor | None = None  # pinned copy of tokens (CUDA); logprobs are then pinned copies too
    done: torch.cuda.Event | None = None
    prompt: dict[int, DeviceLogprobs] | None = None      # prompt logprobs, by row


class TorchRunner:
    def __init__(self, model_dir: str | Path, dtype: str = "auto", device: str = "auto", num_threads: int = 0,
                 attention: str = "auto", compile: bool = False, cuda_graphs: str = "false",
                 max_batch_size: int = 4, seed: int = 0, quantization: str = "none", acts: str = "int8") -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model = load_model(model_dir, dtype, device, quantization, acts)
        cfg = self.model.cfg
        self.dtype = self.model.embed.weight.dtype
        self.ops = kernels.select(attention, self.device.type, str(self.dtype).removeprefix("torch."),
                                  torch.get_num_threads())
        g = Geometry.of(cfg, self.dtype.itemsize)
        self.vocab_size, self.max_model_len, self.eos_token_ids = g.vocab_size, g.max_model_len, g.eos_token_ids
        self.layers, self.kv_shape, self.bytes_per_token, self.scale = g.layers, g.kv_shape, g.bytes_per_token, g.scale
        self.windows = g.windows
        self.paged = False                # init_paged: a block pool; else one dense buffer per sequence
        self.layout: Layout | None = None     # paged: the layer groups (engine/kv/layout.py)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.dense: dict[int, torch.Tensor] = {}
        self.next_buf = 0
        self.generators: dict[int, torch.Generator] = {}
        self.default_generator = torch.Generator(self.device).manual_seed(seed)
        self.tokens_computed = 0
        self.penalties = Penalties(self.vocab_size, self.device)
        self.compiled: CompiledDecode | None = None     # (imported where asked for: inductor is ~140 MiB)
        # decode on a CPU (fp32, bf16): projections and logits through the bandwidth-bound GEMV, and layers as
        # fused C calls (norms, RoPE, SwiGLU and residuals folded in)
        self.gemv = None
        if self.device.type == "cpu" and self.dtype in cpu_gemv.DTYPES:
            self.gemv = cpu_gemv.load(torch.get_num_threads())
            self.model.use_gemv(self.gemv)
            self.model.use_kernels(self.gemv, cpu_pointwise.load(),
                                   cpu_layers.load(torch.get_num_threads(), self.model.layers, cfg.rms_norm_eps,
                                                   cfg.windows, self.model.rope_of))
        if widen.wanted(self.dtype, self.device):
            self.model.use_wide(widen.linear)
        fused = self.model.layers[0].kernels is not None
        stack = self.model.stack
        self.step_rows = stack.max_rows if stack else cpu_gemv.MAX_ROWS if fused else max(8, max_batch_size)
        self.cheap_rows = stack.cheap_rows if stack else self.step_rows
        if self.device.type == "cpu":                               # a decode step's fp32 logits
            heap.keep(max(self.step_rows, max_batch_size) * self.vocab_size * 4)
        self.overlaps = self.device.type == "cuda"
        if compile and fused:
            log.info("compile: decode runs the fused CPU kernels, which outrun the compiled graph; not compiling")
        self.compile = compile and not fused
        # auto: captured graphs on CUDA (unless compiled); true elsewhere runs the same fixed-shape step uncaptured
        self.use_graphs = cuda_graphs == "true" or (cuda_graphs == "auto" and self.device.type == "cuda"
                                                    and not self.compile)
        self.max_batch_size = max_batch_size
        self.graphs: GraphDecode | None = None
        self.graph_step: Step | None = None   # the step whose outputs are the graphs' buffers now

    def kv_budget(self, utilization: float, prefill_tokens: int) -> int | None:
        if self.device.type != "cuda":
            return None
        total = torch.cuda.get_device_properties(self.device).total_memory
        cfg = self.model.cfg
        # an estimate of one prefill step's peak: fp32 logits and their softmax, and the MLP's widest activations
        step = prefill_tokens * (2 * 4 * self.vocab_size + 4 * cfg.intermediate_size * self.dtype.itemsize)
        return int(total * utilization) - torch.cuda.memory_reserved(self.device) - step

    def init_paged(self, num_blocks: int, block_size: int, layout: Layout | None = None) -> None:
        self.paged = True
        self.layout = layout = layout or Layout.of(self.windows, hybrid=False)
        shape = (layout.width, num_blocks + self.use_graphs, block_size, *self.kv_shape)    # + the graphs' scratch
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.model.stack is not None:
            self.model.stack.use_layout(layout.group, layout.slot)
        if self.compile:
            from engine.runners.torch.compiled import CompiledDecode
            self.compiled = CompiledDecode(self.model, self.k_cache, self.v_cache, self.scale, self.gemv, self.windows,
                                           layout)
        if self.use_graphs:
            width = min(num_blocks, -(-self.max_model_len // block_size))
            self.graphs = GraphDecode(self.model, self.ops, self.k_cache, self.v_cache, self.scale,
                                      self.max_batch_size, width, num_blocks, self.device.type == "cuda",
                                      self.windows, layout)

    def dense_alloc(self, capacity: int) -> int:
        buf, self.next_buf = self.next_buf, self.next_buf + 1
        self.dense[buf] = torch.zeros((self.layers, 2, capacity, *self.kv_shape), dtype=self.dtype, device=self.device)
        return buf

    def dense_resize(self, buf: int, capacity: int) -> None:
        old = self.dense[buf]
        new = torch.zeros((self.layers, 2, capacity, *self.kv_shape), dtype=self.dtype, device=self.device)
        n = min(capacity, old.shape[2])
        new[:, :, :n] = old[:, :, :n]
        self.dense[buf] = new

    def dense_free(self, buf: int) -> None:
        del self.dense[buf]

    def dense_copy(self, src: int, dst: int, positions: int) -> None:
        self.dense[dst][:, :, :positions] = self.dense[src][:, :, :positions]

    def copy_block(self, src: int, dst: int) -> None:
        self.k_cache[:, dst] = self.k_cache[:, src]
        self.v_cache[:, dst] = self.v_cache[:, src]

    def row_costs(self) -> tuple[float, float, float] | None:
        """Timed on the model's one-call CPU layers (calibrate.py); None elsewhere: on a device, steps queue behind
        the host and the speculator's defaults stand."""
        if self.model.stack is None:
            return None
        row, late, sampled = calibrate.row_costs(self.model, self.layers, self.kv_shape, self.dtype, self.scale,
                                                 self.cheap_rows, self.step_rows)
        log.info("speculation: a decode row costs %.2f of a one-row step within %d rows, %.2f past them, %.2f more "
                 "drawn at a temperature (timed)", row, self.cheap_rows, late, sampled)
        return row, late, sampled

    def check(self, params: SamplingParams) -> None:
        pass                              # the torch runner honours every field SamplingParams has

    def release(self, seq: int) -> None:
        self.generators.pop(seq, None)
        self.penalties.release(seq)

    def generator_for(self, row: Row) -> torch.Generator:
        if row.params is None or row.params.seed is None:
            return self.default_generator
        gen = self.generators.get(row.seq)
        if gen is None:
            gen = self.generators[row.seq] = torch.Generator(self.device).manual_seed(row.params.seed)
        return gen

    @torch.inference_mode()
    def forward(self, rows: list[Row], prev: Step | None) -> Step:
        ids, positions, chained, last = flatten(rows)
        dev = self.device
        if in_order(chained, len(ids)):
            ids_t = prev.tokens[:len(ids)]
        else:
            ids_t = upload(ids, dev)
            if chained:
                dst, src = zip(*chained)
                ids_t[upload(dst, dev)] = prev.tokens[upload(src, dev)]
        self.tokens_computed += len(ids)
        self.penalties.count(rows, ids_t, last)
        decode = len(ids) == len(rows) and all(r.sample for r in rows)     # one token per row, every row samples
        if decode and self.compiled is not None:
            return Step(rows, self.compiled(ids_t, rows), None)
        if decode and self.graphs is not None and len(rows) <= self.graphs.size:
            last = self.graph_step
            if last is not None and last.logits is not None:      # not sampled yet: keep its logits from the replay
                last.logits, last.greedy = last.logits.clone(), last.greedy.clone()
            logits, greedy = self.graphs.run(rows, ids_t)
            self.graph_step = Step(rows, logits, None, greedy)
            return self.graph_step
        if self.paged:
            attn = torch_attention.paged(self.ops, self.k_cache, self.v_cache, rows, self.scale, dev, self.windows,
                                         self.layout)
        else:
            attn = torch_attention.dense(self.dense, rows, self.scale, self.windows)
        hidden = self.model(ids_t, upload(positions, dev), attn)
        if decode:
            return Step(rows, self.model.logits(hidden), None)
        picked = [i for i, r in enumerate(rows) if r.sample]
        step = Step(rows, self.model.logits(hidden[[last[i] for i in picked]]) if picked else None, picked)
        asked = [(i, r) for i, r in enumerate(rows) if r.prompt_logprobs is not None]
        if asked:
            step.prompt = {i: logprobs.prompt(self.model.logits(hidden[last[i] + 1 - r.length:last[i] + 1]), r)
                           for i, r in asked}
            if self.device.type == "cuda":
                step.prompt = {i: found.to_host() for i, found in step.prompt.items()}
        return step

    @torch.inference_mode()
    def sample(self, step: Step) -> None:
        logits, step.logits = step.logits, None
        greedy, step.greedy = step.greedy, None
        if greedy is not None and all(plain(r) for r in step.rows):
            step.tokens = greedy.clone()          # the graph's buffer is overwritten by the next step
        elif step.picked is None:
            step.tokens, step.logprobs = self._sample(logits, step.rows)
        else:
            step.tokens = torch.full((len(step.rows),), -1, dtype=torch.long, device=self.device)
            if step.picked:
                step.tokens[step.picked], found = self._sample(logits, [step.rows[i] for i in step.picked])
                step.logprobs = found and found.remap(step.picked)
        if self.device.type == "cuda":
            step.host = torch.empty(step.tokens.shape, dtype=step.tokens.dtype, pin_memory=True)
            step.host.copy_(step.tokens, non_blocking=True)
            step.logprobs = step.logprobs and step.logprobs.to_host()
            step.done = torch.cuda.Event()
            step.done.record()

    def _sample(self, logits: torch.Tensor, rows: list[Row]) -> tuple[torch.Tensor, DeviceLogprobs | None]:
        grammar.constrain(logits, rows, self.vocab_size)          # first: raw logprobs see the grammar's mask
        asked = logprob_rows(rows)
        raw = logprobs.raw(logits, asked) if asked else None         # before anything changes the logits
        self.penalties.apply(logits, rows)
        tokens = sample(logits, rows, self.generator_for)
        if raw is None:
            return tokens, None
        return tokens, logprobs.pick(raw, tokens[asked], asked, [rows[i].params.logprobs for i in asked])

    def fetch(self, step: Step) -> Sampled:
        if step.done is not None:
            step.done.synchronize()
        tokens = (step.tokens if step.host is None else step.host).tolist()
        prompt = step.prompt and {i: found.read(len(found.rows)) for i, found in step.prompt.items()}
        return Sampled(tokens, step.logprobs and step.logprobs.read(len(tokens)), prompt)
