"""`packscore check` (core/check.py, packscore/cli.py) on 4 CPU host devices with the tiny model.

One subprocess (XLA_FLAGS=--xla_force_host_platform_device_count=4 must be set before JAX starts) runs the command
several times in one process, so that the runs share JAX's compiles and the CPU reference: a host that passes
(TENSOR_PARALLEL=2 on 4 chips, a given shape, --profile), and three that fail, each for one reason: a model that
does not fit a tiny memory budget, scores past a tolerance (bfloat16 weights against the CPU's float32, compared
for real), and a kernel that does not compile (the engine told the CPU is a TPU: the TPU kernel's compile probe
runs here, and the compiler refuses it). Also `worker --devices all --dry-run`'s plan.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = {"MODEL": "tiny-random", "TENSOR_PARALLEL": "2", "DTYPE": "float32", "ATTENTION": "auto", "PASS_TOKENS": "4096"}


def run(argv: list[str], env: dict[str, str]) -> dict:
    """`packscore` with these arguments and settings in this process: its exit code and what it printed."""
    from packscore.cli import main
    from store.settings import get_settings

    os.environ.update(env)
    get_settings.cache_clear()
    out = io.StringIO()
    code, start = 0, time.monotonic()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return {"code": code, "out": out.getvalue(), "seconds": round(time.monotonic() - start, 1)}


def report() -> dict:
    # A given shape: its request is scored (one CPU reference for all runs) and timed besides the contract's.
    check = ["check", "--chips", "4", "-P", "60", "-N", "7"]
    out = {"dry_run": run(["worker", "--devices", "all", "--chips", "4", "--dry-run"], TINY),
           "passes": run([*check, "--profile"], TINY),
           "too_big": run([*check, "--memory-gb", "0.001", "--json"], TINY),
           "past_tolerance": run([*check, "--tolerance", "1e-4", "--json"], {**TINY, "DTYPE": "bfloat16"})}
    from core.attention import selection

    selection._HOST_PLATFORM["cpu"] = "tpu"  # as on a TPU host whose TPU kernel does not compile
    out["kernel"] = run([*check, "--json"], {**TINY, "ATTENTION": "pallas"})
    return out


def findings(result: dict, section: str, status: str | None = None) -> list[dict]:
    body = json.loads(result["out"])
    return [f for f in body["findings"] if f["section"] == section and status in (None, f["status"])]


def test_check_reports_a_good_host_and_fails_for_each_reason() -> None:
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("PACKSCORE_URL", None)
    proc = subprocess.run([sys.executable, "-m", "tests.test_check"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = json.loads(lines[-1])

    dry = out["dry_run"]["out"].splitlines()
    assert out["dry_run"]["code"] == 0 and dry[0].startswith("4 cpu chips, TENSOR_PARALLEL=2: 2 workers")
    assert len(dry) == 3
    for i, (line, ids) in enumerate(zip(dry[1:], ("0,1", "2,3"))):
        assert line.startswith(f"worker {i}: cpu:{ids}  DEVICE_GROUP=cpu:{ids} JAX_PLATFORMS=cpu XLA_FLAGS="), line
        assert line.endswith("--xla_force_host_platform_device_count=2"), line

    good = out["passes"]
    text = good["out"]
    assert good["code"] == 0, text
    assert "[  ok] plan: 4 cpu chips, TENSOR_PARALLEL=2: 2 workers (cpu:0,1, cpu:2,3)" in text
    assert "[  ok] devices: 4 x cpu (cpu)" in text
    assert "model tiny-random: fits: weights" in text and "x 2 chips" in text
    assert "(host RAM / 2 workers); TENSOR_PARALLEL=2" in text
    assert "model tiny-random: attention: xla" in text
    scores = next(line for line in text.splitlines() if "scores: max |log-prob - CPU float32|" in line)
    assert scores.startswith("[  ok]") and float(scores.split("CPU float32| ")[1].split()[0]) <= 1e-5, scores
    assert "speed (contract, P,N,L = 500,100,20)" in text and "a smaller shape than the contract's" in text
    assert "speed (given, P,N,L = 60,7,20)" in text and "items/s" in text
    assert "on a seeded request (P,N,L = 60,7,20; float32)" in text  # the given shape's scores
    # What bfloat16 gives here, measured in a subprocess with bfloat16's own XLA flags, and a recommendation.
    advice = next(line for line in text.splitlines() if "bfloat16 on this host" in line)
    assert advice.startswith("[info]") and "GFLOP/s against float32's" in advice, advice
    assert "DTYPE=float32 recommended" in advice or "DTYPE=bfloat16 recommended" in advice, advice
    profile = text[text.index("profile (trace:"):]
    assert "XLA's CPU ops on the host's threads" in profile.splitlines()[0]
    table = {line[:28].strip(): float(line.split()[-3]) for line in profile.splitlines()[1:6]}
    assert list(table) == ["matmuls", "attention kernel", "element-wise", "copies", "host gaps"], profile
    assert table["matmuls"] > 0 and table["attention kernel"] == 0, profile  # the CPU's attention: XLA matmuls
    # Beside the table, the passes' host and device time as a worker exports them: within the run's own time.
    host_device = profile.splitlines()[6]
    assert host_device.startswith("         pass host, device"), profile
    host_ms, device_ms = float(host_device.split()[3]), float(host_device.split()[5])
    wall_ms = float(profile.splitlines()[0].split("one request, ")[1].split()[0])
    assert host_ms > 0 and device_ms > 0 and host_ms + device_ms <= wall_ms + 1, profile
    assert "[skip] service: no service" in text and text.rstrip().endswith("check passed")

    too_big = out["too_big"]
    assert too_big["code"] == 1
    fit = findings(too_big, "model tiny-random", "fail")
    assert len(fit) == 1 and "does not fit: the weights alone" in fit[0]["text"], fit
    assert fit[0]["data"]["weight_bytes"] > fit[0]["data"]["budget_bytes"] == 1_000_000

    past = out["past_tolerance"]
    assert past["code"] == 1
    failed = findings(past, "model tiny-random", "fail")
    assert len(failed) == 1 and "scores: max |log-prob - CPU float32|" in failed[0]["text"], failed
    assert failed[0]["data"]["max_abs_diff"] > failed[0]["data"]["tolerance"] == 1e-4

    kernel = out["kernel"]
    assert kernel["code"] == 1
    failed = findings(kernel, "model tiny-random", "fail")
    assert len(failed) == 1 and failed[0]["data"]["attention_path"] == "xla", failed
    assert "XLA block-sparse fallback runs" in failed[0]["text"] and "does not compile" in failed[0]["data"]["reason"]
    cost = [f for f in findings(kernel, "model tiny-random", "info") if "fallback cost" in f["text"]]
    assert cost and cost[0]["data"]["fallback_items_per_s"] > 0
    assert json.loads(kernel["out"])["ok"] is False


if __name__ == "__main__":
    print(json.dumps(report()), flush=True)


def test_profile_reads_a_gpu_trace_by_kernel_names() -> None:
    """The op table of a trace from an H200 (the contract request, 2026-11-28; each kernel's events summed into
    one): kernels inside CUDA graphs name their graph's command buffer as their HLO op, so the kernel's own name
    says what it is (cuBLAS's Hopper matmuls are nvjet_*, the Pallas kernel body_mosaic_gpu_kernel)."""
    import gzip

    from core.check import op_times

    events = json.load(gzip.open(ROOT / "tests" / "data" / "h200-contract-trace.json.gz"))["traceEvents"]
    per_kind, spans, source = op_times(events, {})
    assert source == "trace: device ops"
    ms = {k: round(v / 1e3, 1) for k, v in per_kind.items()}
    assert ms == {"attention kernel": 21.0, "matmuls": 14.9, "element-wise": 10.5, "copies": 8.6}, ms
    # An op its HLO names (the TPU's, a GPU op outside a graph) goes by the programs' HLO instead.
    named = [{**e, "args": {"hlo_op": "fusion.1"}} for e in events if e.get("name") == "loop_convert_fusion_1"]
    assert set(op_times(events[:2] + named, {"fusion.1": "matmuls"})[0]) == {"matmuls"}
