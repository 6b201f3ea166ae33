# SPDX-License-Identifier: Apache-2.0
"""The remote attention backend: vLLM's attention layer, with the math done on attention servers.

Registered as the override of `CPU_ATTN` (CPU ignores `--attention-backend`) and of `CUSTOM`
(GPU, `--attention-backend CUSTOM`). The override path is `SelectedBackend`, resolved lazily by
the module `__getattr__` at model-build time: it is the stock `CPUAttentionBackend` unless
`additional_config["disagg"]["remote_attention"]` is set, so the override is inert otherwise.

The classes are `remote_impl.py`; what they share process-wide (the client the worker installed,
the pipelining runtime's overlap hook, whether new impls are network-bound) is `runtime.py`.
"""

from __future__ import annotations

from vllm_disagg.attention.runtime import (  # noqa: F401 - the state's public names, also here
    current_client,
    get_client,
    network_bound,
    overlap_hook,
    set_client,
    set_network_bound,
    set_overlap_hook,
)
from vllm_disagg.config import disagg_config_from_vllm


def remote_attention_enabled(vllm_config) -> bool:
    if vllm_config is None:
        return False
    cfg = disagg_config_from_vllm(vllm_config)
    return bool(cfg and cfg.remote_attention and cfg.remote_attention.servers)


def __getattr__(name: str):
    if name == "SelectedBackend":
        from vllm.config import get_current_vllm_config_or_none
        from vllm.platforms import current_platform

        if remote_attention_enabled(get_current_vllm_config_or_none()):
            return remote_backend_cls()
        if not current_platform.is_cpu():
            raise ValueError("the CUSTOM attention backend is vllm-disagg's remote attention: set "
                             'additional_config["disagg"]["remote_attention"]["servers"]')
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend
    if name in ("RemoteAttentionBackend", "RemoteAttentionCudaBackend", "RemoteAttentionImpl",
                "RemoteAttentionMetadataBuilder", "build_client_meta"):
        from vllm_disagg.attention import remote_impl

        return getattr(remote_impl, name)
    raise AttributeError(name)


def remote_backend_cls():
    """The remote attention backend class of this platform (CPU or CUDA)."""
    from vllm.platforms import current_platform

    from vllm_disagg.attention import remote_impl

    return remote_impl.RemoteAttentionBackend if current_platform.is_cpu() else remote_impl.RemoteAttentionCudaBackend
