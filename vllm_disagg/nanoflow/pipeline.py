# SPDX-License-Identifier: Apache-2.0
"""Binds the op graph to a loaded vLLM model: the ops of a Llama-family step, per nano-batch.

`LlamaPipeline.try_bind(model)` accepts models that run vLLM's exact Llama code path
(`LlamaModel`/`LlamaDecoderLayer`/`LlamaAttention`/`LlamaMLP` forwards: Llama 2/3 and models
reusing those classes), PP=1, no EAGLE aux outputs. `step(...)` returns the graph ops' closures
over full-batch buffers; each op reads and writes only its nano-batch's rows, so ops of different
nano-batches can run concurrently. Numerics match the stock forward: the same modules run on row
slices, RowParallelLinear's all-reduce is split out as its own op (`ar_o`/`ar_d`) and run on the
"net" unit.

More: README.md, "pipeline.py".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_disagg.nanoflow.graph import ATTN, NET, OpKey, PipelineSpec
from vllm_disagg.overlap import deferred_waits, is_network_bound

# Attention reads the module-global forward context; only one attention op may hold it at a time.
_FWD_CTX_LOCK = threading.Lock()


def _llama_classes() -> tuple[Any, ...]:
    from vllm.model_executor.models import llama

    return llama.LlamaModel, llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP


def _uses_llama_forward(inner: Any) -> bool:
    model_cls, layer_cls, attn_cls, mlp_cls = _llama_classes()
    if type(inner).forward is not model_cls.forward:
        return False
    layers = list(inner.layers[inner.start_layer : inner.end_layer])
    return bool(layers) and all(
        type(ly).forward is layer_cls.forward
        and type(ly.self_attn).forward is attn_cls.forward
        and type(ly.mlp).forward is mlp_cls.forward
        for ly in layers
    )


def _local_linear(mod: Any, x: torch.Tensor) -> torch.Tensor:
    """RowParallelLinear without its all-reduce (the caller runs that as an `ar_*` op)."""
    if getattr(mod, "tp_size", 1) == 1 or not getattr(mod, "reduce_results", False):
        out = mod(x)
        return out[0] if isinstance(out, tuple) else out
    if not mod.input_is_parallel:
        raise ValueError(f"{type(mod).__name__}: nanoflow expects input_is_parallel")
    bias = None if (mod.tp_rank > 0 or mod.skip_bias_add) else mod.bias
    return mod.quant_method.apply(mod, x, bias)


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(x)


@dataclass
class StepState:
    """Per-nano-batch tensors of one step. Coarse tensors are the unit of exchange; a fine op reads
    a row view of its coarse tensor, and a coarse op concatenates fine results only when the fine
    count differs (4/2), so equal counts move no data."""

    positions: torch.Tensor
    fine: list[slice]
    coarse: list[slice]
    contexts: list[Any]
    ratio: int
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # coarse b -> layer input
    residual: dict[int, torch.Tensor] = field(default_factory=dict)  # coarse b -> residual
    qkv: dict[tuple[int, int], tuple] = field(default_factory=dict)
    fine_residual: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    attn_out: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # split network attention: (output, its deferred waits) of requests already sent
    inflight: dict[tuple[int, int], tuple[torch.Tensor, list]] = field(default_factory=dict)
    split_attn: bool = False
    partial: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)

    def local_rows(self, a: int) -> slice:
        """Fine nano-batch `a` as rows of its coarse tensor."""
        base = self.coarse[a // self.ratio].start
        return slice(self.fine[a].start - base, self.fine[a].stop - base)

    def gather(self, parts: dict, layer: int, b: int) -> torch.Tensor:
        pieces = [parts.pop((layer, a)) for a in range(b * self.ratio, (b + 1) * self.ratio)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


@dataclass(frozen=True)
class _LayerOps:
    """One decoder layer's modules, looked up once: each nano-batch's ops would otherwise pay
    `nn.Module.__getattr__` (~14 lookups per nano-batch and layer, ~1 us each) on top of vLLM's
    own per-op cost."""

    input_norm: Any
    qkv_proj: Any
    rotary_emb: Any
    attn: Any
    o_proj: Any
    post_norm: Any
    gate_up_proj: Any
    act_fn: Any
    down_proj: Any

    @classmethod
    def of(cls, layer: Any) -> _LayerOps:
        sa, mlp = layer.self_attn, layer.mlp
        return cls(
            layer.input_layernorm,
            sa.qkv_proj,
            sa.rotary_emb,
            sa.attn,
            sa.o_proj,
            layer.post_attention_layernorm,
            mlp.gate_up_proj,
            mlp.act_fn,
            mlp.down_proj,
        )


class LlamaPipeline:
    """Op closures for a Llama-family model; see module docstring."""

    def __init__(self, model: Any, inner: Any) -> None:
        from vllm.forward_context import override_forward_context
        from vllm.model_executor.layers.fusion.fused_act_quant import maybe_fused_act_quant

        self.model = model
        self.inner = inner
        self.layers = list(inner.layers[inner.start_layer : inner.end_layer])
        self.ops = [_LayerOps.of(ly) for ly in self.layers]
        self._override_ctx = override_forward_context
        self._fused_act = maybe_fused_act_quant
        self.first_is_embedding = inner.start_layer == 0
        attn0 = self.layers[0].self_attn
        self.q_size, self.kv_size = attn0.q_size, attn0.kv_size
        self.tp_size = getattr(attn0.o_proj, "tp_size", 1)
        self.network_bound = any(is_network_bound(ly.self_attn.attn) for ly in self.layers)

    @classmethod
    def try_bind(cls, model: Any) -> LlamaPipeline | None:
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers"):
            return None
        try:
            from vllm.distributed import get_pp_group

            if get_pp_group().world_size > 1:
                return None
        except (AssertionError, ImportError):
            pass
        if getattr(inner, "aux_hidden_state_layers", ()) or not _uses_llama_forward(inner):
            return None
        return cls(model, inner)

    def spec(self, num_attn_batches: int, num_dense_batches: int) -> PipelineSpec:
        return PipelineSpec(
            num_layers=len(self.layers),
            num_attn_batches=num_attn_batches,
            num_dense_batches=num_dense_batches,
            tensor_parallel=self.tp_size > 1,
            attn_unit=NET if self.network_bound else ATTN,
        )

    def relative_cost(self, name: str, tokens: int) -> float:
        """FLOP-proportional default costs; only used to order ops when no plan is loaded."""
        attn0 = self.layers[0]
        d = attn0.post_attention_layernorm.weight.shape[0]
        inter = attn0.mlp.gate_up_proj.output_size_per_partition // 2
        per_token = {
            "kqv": d * (self.q_size + 2 * self.kv_size),
            "attn": 4 * self.q_size * 64,
            "o": self.q_size * d,
            "ugd": 3 * d * inter,
            "ar_o": 2 * d,
            "ar_d": 2 * d,
        }
        return float(per_token[name] * max(tokens, 1))

    # ----------------------------------------------------------------- step
    def begin(self, input_ids, positions, inputs_embeds, fine, coarse, contexts) -> StepState:
        if inputs_embeds is None:
            inputs_embeds = self.inner.embed_input_ids(input_ids)
        hidden = inputs_embeds.contiguous()
        step_state = StepState(
            positions=positions, fine=fine, coarse=coarse, contexts=contexts, ratio=len(fine) // len(coarse)
        )
        for b, rows in enumerate(coarse):
            step_state.hidden[b] = hidden[rows]
            if self.first_is_embedding:
                step_state.residual[b] = hidden[rows]  # layer 0: residual = embedding, norm without add
        return step_state

    def finish(self, step_state: StepState) -> torch.Tensor:
        n = len(step_state.coarse)
        hidden = torch.cat([step_state.hidden[b] for b in range(n)], dim=0) if n > 1 else step_state.hidden[0]
        residual = torch.cat([step_state.residual[b] for b in range(n)], dim=0) if n > 1 else step_state.residual[0]
        out, _ = self.inner.norm(hidden, residual)
        return out

    def op_fns(
        self, step_state: StepState, spec: PipelineSpec, split_network_attention: bool = False
    ) -> dict[OpKey, Callable[[], None]]:
        """`split_network_attention`: KQV sends network-bound attention, "attn" only waits (module
        docstring); the caller guarantees waits run in send order."""
        step_state.split_attn = split_network_attention and self.network_bound
        fns: dict[OpKey, Callable[[], None]] = {}
        for li in range(spec.num_layers):
            for a in range(spec.num_attn_batches):
                fns[("kqv", li, a)] = _bind(self._kqv, step_state, li, a)
                fns[("attn", li, a)] = _bind(self._attn, step_state, li, a)
            for b in range(spec.num_dense_batches):
                fns[("o", li, b)] = _bind(self._o, step_state, li, b)
                fns[("ugd", li, b)] = _bind(self._ugd, step_state, li, b)
                if spec.tensor_parallel:
                    fns[("ar_o", li, b)] = _bind(self._ar, step_state, "o", li, b)
                    fns[("ar_d", li, b)] = _bind(self._ar, step_state, "d", li, b)
        return fns

    def _kqv(self, step_state: StepState, li: int, a: int) -> None:
        ops, b, rows = self.ops[li], a // step_state.ratio, step_state.local_rows(a)
        h, r = step_state.hidden[b][rows], step_state.residual[b][rows]
        if li == 0 and self.first_is_embedding:
            x = ops.input_norm(h)
        else:
            x, r = ops.input_norm(h, r)
        step_state.fine_residual[(li, a)] = r
        qkv, _ = ops.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = ops.rotary_emb(step_state.positions[step_state.fine[a]], q, k)
        if step_state.split_attn:
            self._send_attn(step_state, li, a, q, k, v)
        else:
            step_state.qkv[(li, a)] = (q, k, v)

    def _send_attn(self, step_state: StepState, li: int, a: int, q, k, v) -> None:
        """Issue the request now (the layer returns its output unfilled); `_attn` waits for it."""
        with _FWD_CTX_LOCK, self._override_ctx(step_state.contexts[a]), deferred_waits() as waits:
            out = self.ops[li].attn(q, k, v)
        step_state.inflight[(li, a)] = (out.reshape(q.shape[0], -1), waits)

    def _attn(self, step_state: StepState, li: int, a: int) -> None:
        sent = step_state.inflight.pop((li, a), None)
        if sent is not None:
            out, waits = sent
            for wait in waits:  # fills `out` in place
                wait()
            step_state.attn_out[(li, a)] = out
            return
        q, k, v = step_state.qkv.pop((li, a))
        with _FWD_CTX_LOCK, self._override_ctx(step_state.contexts[a]):
            out = self.ops[li].attn(q, k, v)
        step_state.attn_out[(li, a)] = out.reshape(q.shape[0], -1)

    def _o(self, step_state: StepState, li: int, b: int) -> None:
        attn_out = step_state.gather(step_state.attn_out, li, b)
        step_state.partial[("o", li, b)] = _local_linear(self.ops[li].o_proj, attn_out)

    def _ar(self, step_state: StepState, which: str, li: int, b: int) -> None:
        key = (which, li, b)
        reduced = _all_reduce(step_state.partial.pop(key))
        if which == "d":
            step_state.hidden[b] = reduced
        else:
            step_state.partial[key] = reduced

    def _ugd(self, step_state: StepState, li: int, b: int) -> None:
        ops = self.ops[li]
        residual = step_state.gather(step_state.fine_residual, li, b)
        x, step_state.residual[b] = ops.post_norm(step_state.partial.pop(("o", li, b)), residual)
        gate_up, _ = ops.gate_up_proj(x)
        act = self._fused_act(ops.act_fn, gate_up, ops.down_proj)
        down = _local_linear(ops.down_proj, act)
        if self.tp_size > 1:
            step_state.partial[("d", li, b)] = down
        else:
            step_state.hidden[b] = down


def _bind(fn: Callable, *args: Any) -> Callable[[], None]:
    return lambda: fn(*args)


def sequential_forward(
    model: Any, contexts: list[Any], fine: list[slice], input_ids, positions, inputs_embeds
):
    """Fallback: the whole model per nano-batch, in order, under each slice's forward context."""
    from vllm.forward_context import override_forward_context

    outs = []
    for ctx, rows in zip(contexts, fine):
        with override_forward_context(ctx):
            outs.append(
                model(
                    input_ids=None if input_ids is None else input_ids[rows],
                    positions=positions[..., rows],
                    intermediate_tensors=None,
                    inputs_embeds=None if inputs_embeds is None else inputs_embeds[rows],
                )
            )
    return torch.cat(outs, dim=0)
