"""The summary benchmarks/device_check.sh writes last: `python -m benchmarks.device_summary LOGS [SUMMARY.json]`,
from the steps' outputs in LOGS (each a JSON object after whatever the step logged). Writes SUMMARY.json (keys:
SUMMARY_KEYS) and prints it, with a few lines for a person before it."""

import json
import sys
from pathlib import Path

SUMMARY_KEYS = ("setup", "gpu", "kernels", "steps", "gpu_kernels", "contract", "sglang", "cached_vs_computed",
                "profile_ms", "check_ok", "service", "service_vs_engine")
VARIANTS = ("", "-before", "-ws")  # today's tree and kernel, the before tree, the new GPU kernel


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


def steps(logs: Path) -> dict:
    """steps.txt's lines (NAME rc=N LIMITs-limit Ns, or NAME skipped ... budget) by step."""
    out = {}
    lines = (logs / "steps.txt").read_text().splitlines() if (logs / "steps.txt").is_file() else []
    for line in lines:
        name, status, limit, seconds, *rest = line.split() + [""]
        out[name] = {"rc": int(status[3:]) if status.startswith("rc=") else None, "skipped": status == "skipped",
                     "limit_s": int(limit.split("s")[0]), "seconds": int(seconds.rstrip("s") or 0)}
    return out


def bench(report: dict | None) -> dict | None:
    """One benchmark's figures: items/s, and for one request |cached - computed| and the matmul peak's share."""
    if not report:
        return None
    if "packed_mix" in report:
        mix = report["packed_mix"]
        return {"requests": mix["requests"], "items_per_s": mix["items_per_s"], "seconds": mix["seconds"],
                "padded_tokens": mix["padded_tokens"], "real_tokens": mix["real_tokens"],
                "attention": report["config"].get("attention")}
    packed = report["packed"]
    return {"items_per_s": packed["items_per_s"], "seconds": packed["seconds"],
            "query_cached_items_per_s": report["packed_query_cached"]["items_per_s"],
            "fraction_of_matmul_peak": report.get("fraction_of_matmul_peak"),
            "cached_vs_computed": report.get("max_abs_logprob_diff", {}).get("query_cached_vs_computed"),
            "attention": report.get("config", {}).get("attention")}


def summary(logs: Path) -> dict:
    read = lambda name: (logs / name).read_text().strip() if (logs / name).is_file() else None
    out = {"setup": read("setup.txt"), "gpu": read("gpu.txt"), "kernels": read("kernels.txt"), "steps": steps(logs)}
    # benchmarks.gpu_kernels: a line per kernel (today's, its aligned form, the new one), exactness and time
    out["gpu_kernels"] = [line for line in (read("gpu-kernels.log") or "").splitlines()
                          if line.startswith(("default:", "aligned:", "ws:", "devices:"))]
    for shape in ("contract", "sglang"):
        figures = {}
        for v in VARIANTS:
            try:
                figures[v.lstrip("-") or "after"] = bench(last_json(logs / f"{shape}{v}.log"))
            except (KeyError, TypeError) as exc:
                figures[v.lstrip("-") or "after"] = {"unreadable": repr(exc)}
        out[shape] = figures
    out["cached_vs_computed"] = {name: (f or {}).get("cached_vs_computed") for name, f in out["contract"].items()}
    check = last_json(logs / "check.log")
    profile = [f for f in (check or {}).get("findings", []) if "profile_ms" in f.get("data", {})]
    out["profile_ms"] = profile[0]["data"]["profile_ms"] if profile else None
    out["check_ok"] = check.get("ok") if check else None
    service = last_json(logs / "service.log")
    out["service"] = service
    engine = (out["contract"].get("after") or {}).get("items_per_s")
    out["service_vs_engine"] = {"service_items_per_s": service.get("items_per_s"), "engine_items_per_s": engine,
                                "ratio": round(service["items_per_s"] / engine, 3) if engine else None} \
        if service else None
    return out


def lines(s: dict) -> list[str]:
    text = [s["setup"] or "", s["gpu"] or "no gpu.txt", s["kernels"] or ""]
    text += [f"{name:<18} " + ("skipped (budget)" if step["skipped"] else f"rc={step['rc']} {step['seconds']}s")
             for name, step in s["steps"].items()]
    for shape in ("contract", "sglang"):
        text += [f"{shape:<9}{name:<8}{(f or {}).get('items_per_s', 'no result')} items/s"
                 for name, f in s[shape].items()]
    text.append(f"|cached - computed| {s['cached_vs_computed']}; profile ms {s['profile_ms']}")
    text.append(f"service vs engine: {s['service_vs_engine']}")
    return text


def main() -> None:
    logs = Path(sys.argv[1])
    s = summary(logs)
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(json.dumps(s, indent=2) + "\n")
    print("\n".join(lines(s)))
    print(json.dumps(s))


if __name__ == "__main__":
    main()
