# SPDX-License-Identifier: Apache-2.0
"""Run greedy generation in a fresh process and dump the outputs as JSON (used by inertness tests).

usage: python generate_script.py MODEL OUT.json [DISAGG_JSON]
"""

import json
import os
import sys

from vllm_disagg.testing import apply_test_env

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
CHAT = [[{"role": "user", "content": "What is 2+2? Answer briefly."}]]


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    disagg = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    apply_test_env(in_process=True)
    from vllm import LLM, SamplingParams

    kwargs = {"additional_config": {"disagg": disagg}} if disagg is not None else {}
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, seed=0, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=24)
    completions = llm.generate(PROMPTS, params)
    chats = llm.chat(CHAT, params)
    from vllm.engine.arg_utils import EngineArgs

    result = {
        "plugin_loaded": sys.modules["vllm_disagg"]._registered,
        "patched": hasattr(EngineArgs, "_vllm_disagg_original_add_cli_args"),
        "outputs": [[o.outputs[0].text, list(o.outputs[0].token_ids)] for o in completions + chats],
    }
    with open(out, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
