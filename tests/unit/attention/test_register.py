# SPDX-License-Identifier: Apache-2.0
"""register() points CPU_ATTN at the selector, which stays stock CPU attention unless configured."""

from __future__ import annotations

import types

from vllm_disagg.attention import BACKEND_PATH, register


def test_register_is_idempotent_and_inert_unless_remote_attention_is_configured():
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    register()
    register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND_PATH
    assert AttentionBackendEnum.CPU_ATTN.get_class() is CPUAttentionBackend  # no config: stock

    configured = types.SimpleNamespace(additional_config={"disagg": {"remote_attention": {"servers": ["h:1"]}}})
    with set_current_vllm_config(configured):  # type: ignore[arg-type]
        remote = AttentionBackendEnum.CPU_ATTN.get_class()
    assert remote.get_name() == "CPU_ATTN" and remote.forward_includes_kv_cache_update
    assert remote.get_impl_cls().nanoflow_network_bound

    empty = types.SimpleNamespace(additional_config={"disagg": {"remote_attention": {"servers": []}}})
    with set_current_vllm_config(empty):  # type: ignore[arg-type]
        assert AttentionBackendEnum.CPU_ATTN.get_class() is CPUAttentionBackend
