# SPDX-License-Identifier: Apache-2.0
"""Binds the op graph to a loaded vLLM model: the ops of a Llama-family step, per nano-batch.

`LlamaPipeline.try_bind(model)` accepts models that run vLLM's exact Llama code path
(`LlamaModel`/`LlamaDecoderLayer`/`LlamaAttention`/`LlamaMLP` forwards: Llama 2/3 and models
reusing those classes), PP=1, no EAGLE aux outputs. `step(...)` returns the graph ops' closures
over full-batch buffers; each op reads and writes only its nano-batch's rows, so ops of different
nano-batches can run concurrently. Numerics match the stock forward: the same modules run on row
slices, RowParallelLinear's all-reduce is split out as its own op (`ar_o`/`ar_d`) and run on the
"net" unit.

Anything else uses `sequential_forward`: the whole model per nano-batch, one after another
(correct, no op overlap).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_disagg.nanoflow.graph import ATTN, NET, OpKey, PipelineSpec
from vllm_disagg.nanoflow.overlap import is_network_bound

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


def _norm(norm: Any, x: torch.Tensor, residual_rows: torch.Tensor) -> torch.Tensor:
    """Fused add-RMSNorm on row views; keeps `residual_rows` updated whether or not it ran in place."""
    out, res = norm(x, residual_rows)
    if res.data_ptr() != residual_rows.data_ptr():
        residual_rows.copy_(res)
    return out


@dataclass
class StepState:
    """Full-batch buffers of one step; ops touch only their nano-batch's rows."""

    hidden: torch.Tensor
    residual: torch.Tensor
    attn_out: torch.Tensor
    positions: torch.Tensor
    fine: list[slice]
    coarse: list[slice]
    contexts: list[Any]
    qkv: dict[tuple[int, int], tuple] = field(default_factory=dict)
    partial: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)


class LlamaPipeline:
    """Op closures for a Llama-family model; see module docstring."""

    def __init__(self, model: Any, inner: Any) -> None:
        self.model = model
        self.inner = inner
        self.layers = list(inner.layers[inner.start_layer : inner.end_layer])
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

    def spec(self, n_attn: int, n_dense: int) -> PipelineSpec:
        return PipelineSpec(
            num_layers=len(self.layers),
            n_attn=n_attn,
            n_dense=n_dense,
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
        if inputs_embeds is not None:
            hidden = inputs_embeds
        else:
            hidden = self.inner.embed_input_ids(input_ids)
        hidden = hidden.contiguous()
        return StepState(
            hidden=hidden,
            residual=hidden.clone() if self.first_is_embedding else torch.empty_like(hidden),
            attn_out=hidden.new_empty((hidden.shape[0], self.q_size)),
            positions=positions,
            fine=fine,
            coarse=coarse,
            contexts=contexts,
        )

    def finish(self, st: StepState) -> torch.Tensor:
        out, _ = self.inner.norm(st.hidden, st.residual)
        return out

    def op_fns(self, st: StepState, spec: PipelineSpec) -> dict[OpKey, Callable[[], None]]:
        fns: dict[OpKey, Callable[[], None]] = {}
        for li in range(spec.num_layers):
            for a in range(spec.n_attn):
                fns[("kqv", li, a)] = _bind(self._kqv, st, li, a)
                fns[("attn", li, a)] = _bind(self._attn, st, li, a)
            for b in range(spec.n_dense):
                fns[("o", li, b)] = _bind(self._o, st, li, b)
                fns[("ugd", li, b)] = _bind(self._ugd, st, li, b)
                if spec.tensor_parallel:
                    fns[("ar_o", li, b)] = _bind(self._ar, st, "o", li, b)
                    fns[("ar_d", li, b)] = _bind(self._ar, st, "d", li, b)
        return fns

    def _kqv(self, st: StepState, li: int, a: int) -> None:
        layer, rows = self.layers[li], st.fine[a]
        h = st.hidden[rows]
        if li == 0 and self.first_is_embedding:
            x = layer.input_layernorm(h)  # residual rows already hold the embedding
        else:
            x = _norm(layer.input_layernorm, h, st.residual[rows])
        attn = layer.self_attn
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = attn.rotary_emb(st.positions[rows], q, k)
        st.qkv[(li, a)] = (q, k, v)

    def _attn(self, st: StepState, li: int, a: int) -> None:
        from vllm.forward_context import override_forward_context

        q, k, v = st.qkv.pop((li, a))
        with _FWD_CTX_LOCK, override_forward_context(st.contexts[a]):
            out = self.layers[li].self_attn.attn(q, k, v)
        st.attn_out[st.fine[a]].copy_(out.reshape(q.shape[0], -1))

    def _o(self, st: StepState, li: int, b: int) -> None:
        st.partial[("o", li, b)] = _local_linear(self.layers[li].self_attn.o_proj, st.attn_out[st.coarse[b]])

    def _ar(self, st: StepState, which: str, li: int, b: int) -> None:
        key = (which, li, b)
        st.partial[key] = _all_reduce(st.partial[key])
        if which == "d":
            st.hidden[st.coarse[b]].copy_(st.partial.pop(key))

    def _ugd(self, st: StepState, li: int, b: int) -> None:
        from vllm.model_executor.layers.fusion.fused_act_quant import maybe_fused_act_quant

        layer, rows = self.layers[li], st.coarse[b]
        x = _norm(layer.post_attention_layernorm, st.partial.pop(("o", li, b)), st.residual[rows])
        mlp = layer.mlp
        gate_up, _ = mlp.gate_up_proj(x)
        act = maybe_fused_act_quant(mlp.act_fn, gate_up, mlp.down_proj)
        down = _local_linear(mlp.down_proj, act)
        if self.tp_size > 1:
            st.partial[("d", li, b)] = down
        else:
            st.hidden[rows].copy_(down)


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
