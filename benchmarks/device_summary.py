"""The table benchmarks/device_check.sh prints last: `python -m benchmarks.device_summary OUT`, from the steps'
outputs in OUT (each a JSON object after whatever the step logged)."""

import json
import sys
from pathlib import Path


def last_json(path: Path) -> dict | None:
    """The JSON object a step printed last (the check and the benchmarks print one, after their logs)."""
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    starts = [i for i in range(len(text)) if text[i] == "{" and (i == 0 or text[i - 1] == "\n")]
    for start in reversed(starts):
        try:
            return json.loads(text[start:])
        except json.JSONDecodeError:
            continue
    return None


def bench_line(name: str, report: dict | None) -> str:
    if not report:
        return f"{name:<20} no result"
    if "packed_mix" in report:
        mix = report["packed_mix"]
        return (f"{name:<20} {mix['requests']} requests together: {mix['items_per_s']:.0f} items/s, "
                f"{mix['model_gflops_per_s'] / 1e3:.0f} TFLOP/s, {mix['padded_tokens']} padded of {mix['real_tokens']}")
    packed, cached = report["packed"], report["packed_query_cached"]
    diff = report.get("max_abs_logprob_diff", {})
    return (f"{name:<20} packed {packed['items_per_s']:.0f} items/s ({packed['seconds'] * 1e3:.1f} ms, "
            f"{packed['model_gflops_per_s'] / 1e3:.0f} TFLOP/s, {report['fraction_of_matmul_peak']} of peak "
            f"{max(p['jax_bfloat16'] for p in report['matmul_peak_gflops']) / 1e3:.0f}); query cached "
            f"{cached['items_per_s']:.0f} items/s; |cached - computed| {diff.get('query_cached_vs_computed', 'n/a')}")


def check_lines(name: str, report: dict | None) -> list[str]:
    if not report:
        return [f"{name:<16} no result"]
    lines = [f"{name:<16} ok={report['ok']}"]
    for finding in report["findings"]:
        if finding["section"].startswith("model") or finding["status"] == "fail":
            lines.append(f"  [{finding['status']}] {finding['text'][:900]}")
    return lines


def main() -> None:
    out = Path(sys.argv[1])
    lines = [(out / "gpu.txt").read_text().strip() if (out / "gpu.txt").is_file() else "no gpu.txt"]
    lines += [(out / "steps.txt").read_text().strip() if (out / "steps.txt").is_file() else "no steps"]
    if (out / "gpu-kernels.log").is_file():
        lines += [line for line in (out / "gpu-kernels.log").read_text().splitlines()
                  if line.startswith(("default:", "aligned:", "ws:", "devices:"))]
    for name in ("check", "check-aligned"):
        lines += check_lines(name, last_json(out / f"{name}.log"))
    for name in ("bench", "bench-ws", "bench-b31e77f", "bench-aligned", "bench-pinned", "bench-aligned-pinned",
                 "bench-requests"):
        try:
            lines.append(bench_line(name, last_json(out / f"{name}.log")))
        except (KeyError, TypeError, ValueError) as exc:
            lines.append(f"{name:<20} unreadable: {exc!r}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
