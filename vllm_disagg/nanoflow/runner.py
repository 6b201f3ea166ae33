# SPDX-License-Identifier: Apache-2.0
"""The nano-batch model runner: a mixin over vLLM's V1 runner (CPU and GPU).

Lifecycle per step (inert unless `additional_config["disagg"]["nanoflow"]` is set):
1. `_determine_batch_execution_and_padding` asks vLLM's ubatch path to split the step
   (`should_ubatch=True`) when the batch has at least as many tokens as fine nano-batches; vLLM then
   builds the slices (`maybe_create_ubatch_slices`) and per-slice attention metadata and slot
   mappings (`split_attn_metadata`) exactly as for DBO.
2. `_model_forward` finds those in the forward context, builds one forward context per slice, and
   runs the op graph (`LlamaPipeline` + `OpGraphExecutor`) or, for other models, the sequential
   fallback.
Achieved throughput is logged as a fraction of the cost model's optimum (`throughput.py`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.logger import init_logger

from vllm_disagg import envs
from vllm_disagg.config import disagg_config_from_vllm
from vllm_disagg.nanoflow.auto import has_network_op
from vllm_disagg.nanoflow.executor import OpGraphExecutor
from vllm_disagg.nanoflow.graph import ATTN, DENSE, NET, build_graph, list_schedule
from vllm_disagg.nanoflow.kv_save import nano_batched_saves
from vllm_disagg.nanoflow.pingpong import pingpong_forward
from vllm_disagg.nanoflow.pipeline import LlamaPipeline, sequential_forward
from vllm_disagg.nanoflow.plan import NanoFlowPlan, resolve_plan
from vllm_disagg.nanoflow.throughput import PairedSteps, ThroughputLog
from vllm_disagg.nanoflow.units import make_units, set_num_threads
from vllm_disagg.overlap import is_network_bound
from vllm_disagg.patches import require
from vllm_disagg.patches.worker_ubatching import set_worker_ubatching

logger = init_logger(__name__)
REQUIRED_PATCHES = ("worker_ubatching", "couplings")

AB_ENV = envs.VLLM_DISAGG_NANOFLOW_AB
"""Diagnostic (`envs.nanoflow_ab()`): "1" alternates nano-batched and plain forwards of eligible
steps in one engine and reports both in `nanoflow_stats()["ab"]` (same process, same load: a
paired overhead figure)."""


def nanoflow_plan_of(vllm_config: Any) -> NanoFlowPlan | None:
    """The resolved plan when nanoflow is configured, else None (inert)."""

    cfg = disagg_config_from_vllm(vllm_config)
    if cfg is None or cfg.nanoflow is None:
        return None
    nanoflow = cfg.nanoflow
    network = nanoflow.num_nano_batches == "auto" and has_network_op(vllm_config)
    return resolve_plan(nanoflow.num_nano_batches, nanoflow.plan, vllm_config.model_config.model, network)


def enable_nano_ubatching(vllm_config: Any) -> int:
    """Turn on vLLM's ubatch plumbing in this worker for the configured plan; returns the fine
    nano-batch count (0 when nanoflow is off or the count is 1)."""
    plan = nanoflow_plan_of(vllm_config)
    if plan is None or plan.nano_batches.attn < 2:
        return 0
    parallel_config = vllm_config.parallel_config
    if parallel_config.data_parallel_size > 1 or parallel_config.enable_dbo or parallel_config.pipeline_parallel_size > 1:
        raise ValueError(
            "nanoflow: nano-batching does not combine with data/pipeline parallelism or DBO "
            f"(dp={parallel_config.data_parallel_size}, pp={parallel_config.pipeline_parallel_size}, dbo={parallel_config.enable_dbo}); "
            'remove additional_config["disagg"]["nanoflow"] or those flags'
        )
    require("nano-batching", *REQUIRED_PATCHES)
    set_worker_ubatching(parallel_config, plan.nano_batches.attn)
    return plan.nano_batches.attn


def cpu_exclusive_units(shares: dict[str, int], device: torch.device) -> frozenset[str]:
    """On CPU, every unit that runs vLLM's attention or GEMM kernels (all but "net") must not
    overlap another: those kernels share one process-global scratchpad (executor docstring)."""
    if device.type != "cpu":
        return frozenset()
    return frozenset(name for name in shares if name != NET)


def reset_runner_stats(runner: Any) -> None:
    """Zero the step counters, the throughput log and the A/B buckets (benchmarks: after warm-up)."""
    stats = getattr(runner, "nano_stats", None)
    if stats:
        for key in stats:
            stats[key] = 0
    tput = getattr(runner, "_nano_tput", None)
    if tput is not None:
        tput.tokens, tput.seconds = 0, 0.0
    if getattr(runner, "_nano_ab", None) is not None:
        runner._nano_ab = PairedSteps()


def _has_network_bound_attention(vllm_config: Any) -> bool:
    layers = vllm_config.compilation_config.static_forward_context.values()
    return any(is_network_bound(ly) for ly in layers if hasattr(ly, "impl"))


def runner_stats(runner: Any) -> dict:
    stats = dict(getattr(runner, "nano_stats", {}) or {})
    if getattr(runner, "nano_plan", None) is not None and hasattr(runner, "nano_overlap"):
        stats["overlap"] = runner.nano_overlap()
    tput = getattr(runner, "_nano_tput", None)
    if tput is not None:
        stats.update(tput.summary())
    executor = getattr(runner, "nano_executor", None)
    if executor is not None:
        stats["units"] = [u.describe() for u in executor.units.values()]
        stats["inline"] = executor.inline
    stats["pipeline"] = getattr(runner, "nano_pipeline", None) is not None
    plan = getattr(runner, "nano_plan", None)
    # False: this runner never splits (num_nano_batches "auto" picked n=1): vLLM's plain forward, plain runner
    stats["nano_batching"] = isinstance(runner, NanoFlowRunnerMixin) and plan is not None and plan.nano_batches.attn > 1
    stats["runner"] = type(runner).__name__
    ab = getattr(runner, "_nano_ab", None)
    if ab is not None and ab.summary():
        stats["ab"] = ab.summary()
    return stats


class NanoFlowRunnerMixin:
    """Put first in the bases: `class R(NanoFlowRunnerMixin, CPUModelRunner)`."""

    def __init__(self, vllm_config: Any, device: torch.device, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, device, *args, **kwargs)
        self.init_nanoflow(vllm_config)

    def init_nanoflow(self, vllm_config: Any) -> None:
        """Mixin state; call it yourself after swapping `runner.__class__` to a nanoflow class."""
        self.nano_plan = nanoflow_plan_of(vllm_config)
        self.nano_pipeline: LlamaPipeline | None = None
        self.nano_executor: OpGraphExecutor | None = None
        self._nano_turns = False
        self.nano_stats = dict.fromkeys(
            (
                "steps",
                "nano_steps",
                "pipeline_steps",
                "fallback_steps",
                "prefill_steps",
                "decode_steps",
                "mixed_steps",
                "split_attention_steps",  # network attention sent from KQV, waited on the net unit
                "plain_steps",  # below the plan's break-even (or n=1): vLLM's plain forward
                "turn_steps",  # off the Llama op path: nano-batch threads taking turns (pingpong.py)
            ),
            0,
        )
        self._nano_schedules: dict[Any, Any] = {}
        self._nano_split_ok: dict[Any, bool] = {}  # spec -> send network attention from KQV
        self._nano_tput: ThroughputLog | None = None
        self._nano_ab: PairedSteps | None = None
        if self.nano_plan is not None and envs.nanoflow_ab():
            self._nano_ab = PairedSteps()

    # --------------------------------------------------------------- setup
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        if self.nano_plan is None:
            return
        self.model = _unwrap_ubatch_wrapper(self.model)
        self.nano_pipeline = LlamaPipeline.try_bind(self.model)
        self._nano_turns = self.nano_pipeline is None and _has_network_bound_attention(self.vllm_config)
        if self.nano_pipeline is None:
            # the overlap this step can have, stated once (also nanoflow_stats()["overlap"])
            logger.warning("nanoflow: %s is not on the Llama op path; %s", type(self.model).__name__,
                           self.nano_overlap())
        shares = self._nano_unit_shares()
        self.nano_executor = OpGraphExecutor(
            make_units(shares, self.device),
            inline=len(shares) <= 1,
            exclusive_units=cpu_exclusive_units(shares, self.device),
        )
        self._nano_tput = ThroughputLog(self.vllm_config, self.nano_plan)
        logger.info(
            "nanoflow: nano-batches attn=%d dense=%d, units %s%s",
            self.nano_plan.nano_batches.attn,
            self.nano_plan.nano_batches.dense,
            shares,
            " (inline)" if self.nano_executor.inline else "",
        )

    def nano_overlap(self) -> str:
        """What overlaps in a nano-batched step of this model (the plan, in words)."""
        if self.nano_pipeline is not None:
            return "op graph: ops of different nano-batches overlap on execution units (pipeline.py)"
        if self._nano_turns:
            return ("turn taking: a nano-batch's dense layers (MoE experts included) run while another waits "
                    "for its network-bound attention (pingpong.py)")
        return ("sequential: nano-batches run one after another (no network-bound op to overlap; on CPU "
                "local attention and GEMMs share the cores)")

    def _nano_unit_shares(self) -> dict[str, int]:
        plan, pipe = self.nano_plan, self.nano_pipeline
        assert plan is not None
        needs_net = pipe is not None and (pipe.tp_size > 1 or pipe.network_bound)
        if not plan.threaded or pipe is None:
            return {DENSE: 0}
        shares = dict(plan.units) or {DENSE: 0}
        if needs_net:
            shares.setdefault(NET, 0)
        return shares

    def nano_spec(self):
        plan, pipe = self.nano_plan, self.nano_pipeline
        spec = pipe.spec(plan.nano_batches.attn, plan.nano_batches.dense)
        if spec.attn_unit == ATTN and ATTN not in self.nano_executor.units:
            spec = type(spec)(**{**spec.__dict__, "attn_unit": DENSE})
        return spec

    def _build_attention_metadata(self, *args: Any, **kwargs: Any):
        """CPU attention bakes the builder thread's OpenMP width into its metadata: build it with
        the width of the unit that will run attention."""
        width = self._nano_attn_threads() if kwargs.get("ubatch_slices") is not None else None
        if width is None:
            return super()._build_attention_metadata(*args, **kwargs)
        before = torch.get_num_threads()
        set_num_threads(width)
        try:
            return super()._build_attention_metadata(*args, **kwargs)
        finally:
            set_num_threads(before)

    def _nano_attn_threads(self) -> int | None:
        ex = self.nano_executor
        if ex is None or ex.inline or self.device.type != "cpu":
            return None
        width = getattr(ex.units.get(self.nano_spec().attn_unit), "num_threads", None)
        return width if width and width != torch.get_num_threads() else None

    # ------------------------------------------------------ step decisions
    def _determine_batch_execution_and_padding(self, *args: Any, **kwargs: Any):
        mode, desc, should_ubatch, across_dp, stats = super()._determine_batch_execution_and_padding(
            *args, **kwargs
        )
        plan = self.nano_plan
        if (
            plan is not None
            and plan.nano_batches.attn >= 2
            and self.vllm_config.parallel_config.data_parallel_size == 1
        ):
            num_tokens = kwargs.get("num_tokens", args[0] if args else 0)
            num_reqs = kwargs.get("num_reqs", args[1] if len(args) > 1 else 0)
            allowed = kwargs.get("allow_microbatching", True)
            least = max(plan.min_tokens(), plan.break_even_tokens or 0)
            should_ubatch = bool(allowed and num_reqs >= 1 and min(num_tokens, desc.num_tokens) >= least)
            if should_ubatch and self._nano_ab is not None:
                should_ubatch = self._nano_ab.choose_nano(int(num_tokens))
            if should_ubatch:
                self._count_step_kind(kwargs.get("num_scheduled_tokens_np"), num_reqs)
        return mode, desc, should_ubatch, across_dp, stats

    def _count_step_kind(self, scheduled: Any, num_reqs: int) -> None:
        if scheduled is None:
            return
        lens = scheduled[:num_reqs]
        has_prefill, has_decode = bool((lens > 1).any()), bool((lens == 1).any())
        kind = (
            "mixed_steps"
            if has_prefill and has_decode
            else "prefill_steps"
            if has_prefill
            else "decode_steps"
        )
        self.nano_stats[kind] += 1

    # -------------------------------------------------------------- forward
    def _model_forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **model_kwargs: Any,
    ):
        from vllm.forward_context import get_forward_context, is_forward_context_available

        ctx = get_forward_context() if is_forward_context_available() else None
        if self.nano_plan is None or ctx is None or ctx.ubatch_slices is None:
            if self.nano_plan is not None:
                self.nano_stats["steps"] += 1
                self.nano_stats["plain_steps"] += 1
            if self._nano_ab is None or not self._nano_ab.plain_next:
                return super()._model_forward(
                    input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs
                )
            start, cpu_start = time.perf_counter(), time.thread_time()
            out = super()._model_forward(
                input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs
            )
            self._nano_ab.record(
                "plain", int(out.shape[0]), time.perf_counter() - start, self._ab_cpu(cpu_start, True)
            )
            return out
        start, cpu_start = time.perf_counter(), time.thread_time()
        fine = [s.token_slice for s in ctx.ubatch_slices]
        contexts = _slice_contexts(ctx, self.vllm_config)
        with nano_batched_saves(len(fine)):  # a KV connector saves a layer once all nano-batches wrote it
            if self.nano_pipeline is None or intermediate_tensors is not None or model_kwargs:
                if self._nano_turns and intermediate_tensors is None and not model_kwargs:
                    out = pingpong_forward(self.model, contexts, fine, input_ids, positions, inputs_embeds)
                    self.nano_stats["turn_steps"] += 1
                else:
                    out = sequential_forward(self.model, contexts, fine, input_ids, positions, inputs_embeds)
                self.nano_stats["fallback_steps"] += 1
            else:
                out = self._run_pipeline(fine, contexts, input_ids, positions, inputs_embeds)
                self.nano_stats["pipeline_steps"] += 1
        self.nano_stats["steps"] += 1
        self.nano_stats["nano_steps"] += 1
        if self._nano_tput is not None and ctx.attn_metadata is not None:
            self._nano_tput.record(int(fine[-1].stop), time.perf_counter() - start)
        if self._nano_ab is not None:
            inline = self.nano_executor is not None and self.nano_executor.inline
            self._nano_ab.record(
                "nano", int(fine[-1].stop), time.perf_counter() - start, self._ab_cpu(cpu_start, inline)
            )
        return out

    @staticmethod
    def _ab_cpu(cpu_start: float, on_this_thread: bool) -> float | None:
        """This thread's CPU time since `cpu_start`, when it did all the forward's work."""
        if not on_this_thread or torch.get_num_threads() != 1:
            return None
        return time.thread_time() - cpu_start

    def _run_pipeline(self, fine, contexts, input_ids, positions, inputs_embeds) -> torch.Tensor:
        spec = self.nano_spec()
        k = spec.ratio
        coarse = [slice(fine[b * k].start, fine[b * k + k - 1].stop) for b in range(spec.num_dense_batches)]
        pipe = self.nano_pipeline
        step_state = pipe.begin(input_ids, positions, inputs_embeds, fine, coarse, contexts)
        nodes, schedule = self._nano_schedule(spec, int(fine[-1].stop))
        split = self._nano_split_attention(spec, schedule)
        fns = pipe.op_fns(step_state, spec, split_network_attention=split)
        self.nano_stats["split_attention_steps"] += int(split and pipe.network_bound)
        self.nano_executor.run(nodes, schedule, fns)
        return pipe.finish(step_state)

    def _nano_schedule(self, spec, num_tokens: int):
        """Schedules depend only on the pipeline shape; cached per spec."""

        if spec not in self._nano_schedules:
            nodes = build_graph(spec)
            costs = self.nano_plan.op_cost_s
            num_batches_of = {"kqv": spec.num_attn_batches, "attn": spec.num_attn_batches}

            def cost(node) -> float:
                tokens = max(1, num_tokens // num_batches_of.get(node.name, spec.num_dense_batches))
                if node.name in costs and costs[node.name]:
                    return _interp(costs[node.name], tokens)
                if node.name == "attn" and spec.attn_unit == NET:
                    # remote attention (server kernel over the whole context + round trip) is not
                    # FLOP-proportional here; taken as long as a nano-batch's dense layer, the list
                    # schedule issues each nano-batch's next kqv right after its own o/ugd (ping-pong
                    # order) instead of after the other nano-batch's, which left the net unit idle
                    rel = self.nano_pipeline.relative_cost
                    return sum(rel(name, tokens) for name in ("kqv", "o", "ugd"))
                return self.nano_pipeline.relative_cost(node.name, tokens)

            serial = self.nano_executor.exclusive_units
            self._nano_schedules[spec] = (nodes, list_schedule(nodes, cost, serial))
        return self._nano_schedules[spec]

    def _nano_split_attention(self, spec, schedule) -> bool:
        """Send network-bound attention from KQV and only wait on the net unit (pipeline.py):
        when attention runs on the threaded "net" unit in the order the dense unit sends."""
        ok = self._nano_split_ok.get(spec)
        if ok is None:
            ok = self._nano_split_ok[spec] = (
                spec.attn_unit == NET and not self.nano_executor.inline and sends_in_wait_order(schedule, spec)
            )
        return ok


def sends_in_wait_order(schedule, spec) -> bool:
    """Split network attention (pipeline.py) sends each request in its KQV op and waits for it in
    its "attn" op; replies come back in send order per server channel, so the attention unit must
    wait in the order the KQV unit sends."""
    kqv = [key[1:] for key in schedule.order.get(DENSE, []) if key[0] == "kqv"]
    attn = [key[1:] for key in schedule.order.get(spec.attn_unit, []) if key[0] == "attn"]
    return kqv == attn and len(attn) == spec.num_layers * spec.num_attn_batches


def _interp(table: dict[str, float], tokens: int) -> float:
    pts = sorted((int(k), v) for k, v in table.items())
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if tokens <= x1:
            return y0 + (y1 - y0) * (max(tokens, x0) - x0) / max(1, x1 - x0)
    return pts[-1][1] * tokens / max(1, pts[-1][0])


def _slice_contexts(ctx: Any, vllm_config: Any) -> list[Any]:
    """One forward context per nano-batch, as vLLM's UBatchWrapper builds them."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import create_forward_context

    n = len(ctx.ubatch_slices)
    slot_mapping = ctx.slot_mapping if isinstance(ctx.slot_mapping, list) else None
    return [
        create_forward_context(
            ctx.attn_metadata[i] if ctx.attn_metadata is not None else None,
            vllm_config,
            batch_descriptor=ctx.batch_descriptor,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping=slot_mapping[i] if slot_mapping else None,
            skip_compiled=ctx.skip_compiled,
        )
        for i in range(n)
    ]


def _unwrap_ubatch_wrapper(model: Any) -> Any:
    """The GPU runner wraps the model in UBatchWrapper when ubatching is on (needs DP); undo it."""
    try:
        from vllm.v1.worker.gpu_ubatch_wrapper import UBatchWrapper
    except ImportError:
        return model
    return model.unwrap() if isinstance(model, UBatchWrapper) else model


def nanoflow_runner_cls(base: type) -> type:
    """`(NanoFlowRunnerMixin, base)`, cached, so workers can nano-batch any V1 runner."""
    if issubclass(base, NanoFlowRunnerMixin):
        return base
    cls = _RUNNER_CLASSES.get(base)
    if cls is None:
        cls = type(f"NanoFlow{base.__name__}", (NanoFlowRunnerMixin, base), {"__module__": __name__})
        _RUNNER_CLASSES[base] = cls
    return cls


_RUNNER_CLASSES: dict[type, type] = {}
