# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg plan ...` end to end through the real console entry point."""

import json

import pytest

from vllm_disagg.cli.main import main


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_nanoflow_prints_table2_as_json(capsys):
    out = _json(capsys, ["plan", "nanoflow", "--model", "llama-2-70b", "--gpu", "a100-80g",
                         "--num-gpus", "8", "--dense-batch", "2048", "--prompt", "512",
                         "--output", "1024", "--json"])
    assert out["totals_ms"]["t_compute"] == pytest.approx(114.17, rel=0.01)
    assert out["optimal_throughput_tok_s"] == pytest.approx(17828, abs=1)
    assert out["verdict_eq8"] == "compute-bound"


def test_plan_nanoflow_reads_a_hf_config_and_draws_the_op_chart(capsys, tiny_model_dir, tmp_path):
    png = tmp_path / "ops.png"
    out = _json(capsys, ["plan", "nanoflow", "--model-config", f"{tiny_model_dir}/config.json",
                         "--gpu", "h100", "--num-gpus", "1", "--json", "--plot", str(png)])
    assert out["num_gpus"] == 1 and png.stat().st_size > 1000


def test_plan_lamina_matches_the_issue_example(capsys):
    out = _json(capsys, ["plan", "lamina", "--model", "llama3-70b", "--compute-gpu", "h100",
                         "--memory-gpu", "h20", "--dop", "2,4", "--batch", "300", "--context",
                         "4096", "--alpha", "0.2", "--json"])
    (dop,) = out["dops"]
    assert dop["label"] == "DOP=(2,4)" and dop["cost_per_hour"] == pytest.approx(40.64)
    assert dop["baseline"]["cost_per_hour"] == pytest.approx(44.24)


def test_plan_lamina_table_and_bandwidth_plot(capsys, tmp_path):
    png = tmp_path / "bw.png"
    assert main(["plan", "lamina", "--dop", "2,2", "--dop", "4,4", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "DOP=(2,2)" in text and "DOP=(4,4)" in text and png.exists()


def test_plan_splitwise_simulates_one_cluster(capsys):
    out = _json(capsys, ["plan", "splitwise", "--design", "HH", "--trace", "conversation",
                         "--target-rps", "5", "--duration", "5", "--simulate", "2,2", "--json"])
    sim = out["simulated"]
    assert (sim["num_prompt"], sim["num_token"]) == (2, 2) and sim["ok"]


def test_plan_splitwise_search_plots_the_design_space(capsys, tmp_path):
    png = tmp_path / "space.png"
    out = _json(capsys, ["plan", "splitwise", "--design", "HA", "--trace", "coding",
                         "--target-rps", "4", "--duration", "10", "--max-prompt", "4",
                         "--max-token", "4", "--objective", "cost", "--json", "--plot", str(png)])
    assert out["best"]["ok"] and png.exists()
    assert out["iso_power_a100_for_budget"] == 70


def test_plan_splitwise_validate_compares_a_measured_1p1d_run(capsys, tmp_path,
                                                              tiny_model_dir):
    prof = {"schema": "vllm-disagg-profile/1", "device": "cpu",
            "prefill": [{"num_tokens": 1, "ms": 5}, {"num_tokens": 512, "ms": 60}],
            "decode": [{"batch_size": 1, "ms": 8}, {"batch_size": 16, "ms": 14}],
            "kv_transfer": [{"num_tokens": 0, "ms": 0.5}, {"num_tokens": 512, "ms": 3}],
            "machine": {"kv_capacity_tokens": 20000, "first_token_on": "prefill"},
            "measured": {"rps": 2, "prompt_tokens": 256, "output_tokens": 16,
                         "num_requests": 32, "ttft_ms_p50": 40.0, "tbt_ms_p50": 9.0}}
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(prof))
    out = _json(capsys, ["plan", "splitwise", "--model-config", f"{tiny_model_dir}/config.json",
                         "--profile", str(path), "--validate", "--json"])
    assert out["predicted"]["ttft_ms_p50"] == pytest.approx(5 + 55 * 255 / 511, rel=0.05)
    assert set(out["relative_error"]) == {"ttft_ms_p50", "tbt_ms_p50"}


def test_plan_without_a_model_prints_help(capsys):
    assert main(["plan"]) == 2


def test_lamina_picks_the_dop_with_the_most_tokens_per_dollar(capsys):
    out = _json(capsys, ["plan", "lamina", "--model", "llama-65b", "--dop", "2,2,2,4,4,8",
                         "--context", "1260", "--batch", "10000", "--json"])
    best = max(out["dops"], key=lambda r: r["tok_per_dollar"])
    assert out["best_dop"] == best["label"]


def test_the_planner_imports_without_vllm_or_torch():
    import subprocess
    import sys

    code = ("import sys, vllm_disagg.planner.cli, vllm_disagg.planner.provision; "
            "print('vllm' in sys.modules or 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_unknown_model_is_one_clear_error_line(capsys):
    assert main(["plan", "lamina", "--model", "gpt-7"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'gpt-7'" in err and "Traceback" not in err
