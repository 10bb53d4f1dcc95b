"""benchmarks/device_check.sh, the one call of a lent GPU, checked here without one: its dry mode
(DEVICE_CHECK_DRY=1: every step on the CPU, tiny-random, tiny shapes) runs every step and writes the summary's
keys with figures in them; the summary reads the new kernel's steps where they ran."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import device_summary

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
STEPS = ("gpu-kernels", "contract", "sglang", "check", "service", "contract-before", "sglang-before")


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.alone  # each step has a time limit
def test_dry_run_runs_every_step_and_writes_the_summary(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PACKSCORE_GPU_KERNEL", "STEPS", "BEFORE")}
    env.update(DEVICE_CHECK_DRY="1", OUT=str(tmp_path / "out"), LOGS=str(tmp_path / "logs"), PYTHON=sys.executable,
               BUDGET="900", PYTHONPATH=str(ROOT))
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert tuple(summary) == device_summary.SUMMARY_KEYS
    ran = {name: step["rc"] for name, step in summary["steps"].items()}
    assert ran == dict.fromkeys(STEPS, 0), (tmp_path / "logs" / "steps.txt").read_text()
    assert summary["kernels"].startswith("ws: not run")  # no PACKSCORE_GPU_KERNEL: today's kernel only
    for shape in ("contract", "sglang"):
        assert summary[shape]["after"]["items_per_s"] > 0 and summary[shape]["before"]["items_per_s"] > 0
        assert summary[shape]["ws"] is None
    assert summary["sglang"]["after"]["requests"] == 4
    assert 0 <= summary["cached_vs_computed"]["after"] < 1e-4  # docs/score-semantics.md's isolation rule
    assert set(summary["profile_ms"]) >= {"matmuls", "attention kernel", "element-wise", "copies"}
    assert summary["service"]["statuses"] == ["succeeded"] and summary["service"]["jobs"] == 24
    assert summary["service_vs_engine"]["ratio"] > 0
    assert {line.split(":")[0] for line in summary["gpu_kernels"]} >= {"default", "aligned", "ws"}
    assert (tmp_path / "out" / "logs.tgz").is_file()


def test_the_summary_reads_the_new_kernels_steps(tmp_path):
    one = {"config": {"attention": "pallas-mosaic-gpu-ws"}, "packed": {"items_per_s": 9000.0, "seconds": 0.05},
           "packed_query_cached": {"items_per_s": 9500.0}, "fraction_of_matmul_peak": 0.4,
           "max_abs_logprob_diff": {"query_cached_vs_computed": 0.0}}
    many = {"config": {"attention": "pallas"}, "packed_mix": {"requests": 128, "items_per_s": 7000.0, "seconds": 0.2,
                                                             "padded_tokens": 10, "real_tokens": 64000}}
    (tmp_path / "contract-ws.log").write_text("compiling...\n" + json.dumps(one, indent=2))
    (tmp_path / "sglang-ws.log").write_text(json.dumps(many))
    (tmp_path / "gpu-kernels.log").write_text("devices: [cuda]\nws: rows bitwise ...\nother\n")
    (tmp_path / "steps.txt").write_text("contract-ws rc=0 90s-limit 41s\nsglang-ws skipped 90s-limit 0s budget\n")
    summary = device_summary.summary(tmp_path)
    assert summary["contract"]["ws"]["items_per_s"] == 9000.0 and summary["contract"]["after"] is None
    assert summary["sglang"]["ws"]["requests"] == 128
    assert summary["cached_vs_computed"]["ws"] == 0.0
    assert summary["gpu_kernels"] == ["devices: [cuda]", "ws: rows bitwise ..."]
    assert summary["steps"]["contract-ws"] == {"rc": 0, "skipped": False, "limit_s": 90, "seconds": 41}
    assert summary["steps"]["sglang-ws"]["skipped"] is True
