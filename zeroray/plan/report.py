"""The text form of a plan (``zeroray plan`` without ``--json``)."""
from __future__ import annotations

from typing import Any, Dict, List

from zeroray.plan.planner import count


def format_plan(p: Dict[str, Any]) -> str:
    lines: List[str] = []
    if "stages" in p:
        lines.append(f"{p['model']}: {count(p['params'])} params, seq {p['seq_len']}, micro-batch {p['micro_batch']}"
                     f" x accum {p['accum']}, {p['dtype']}, on {p['gpus']} x {p['gpu']} "
                     f"({p['gpu_memory_gb']:.3g} GB each, margin {p['margin']:.0%})" +
                     (f", tensor parallel {p['tp']}" if p["tp"] > 1 else "") +
                     (f", offload={p['offload']}" + (" (on paper: not built yet)" if p["offload"] == "cpu" else "")
                      if p.get("offload") else ""))
        cols = ("stage", "GB/GPU", "fits", "step s", "tok/s/GPU", "MFU", "exposed comm s", "bucket MiB", "window MiB")
        rows = [cols]
        for s, r in p["stages"].items():
            rows.append((s, f"{r['memory_gb']:.1f}", "yes" if r["fits"] else "no", f"{r['step_s']:.3f}",
                         f"{r['tokens_per_s_per_gpu']:.0f}", f"{r['mfu']:.1%}", f"{r['exposed_comm_s']:.3f}",
                         f"{r['bucket_mib']:.0f}", f"{r['window_mib']:.0f}" if s == "3" else "-"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
        rec = p.get("recommended")
        lines.append(f"recommended: stage {rec}" if rec is not None else
                     "recommended: none fits; use more GPUs, tensor parallelism or a smaller micro-batch")
    if "largest" in p:
        lines.append("largest model that fits (GPT shape, same settings): " +
                     ", ".join(f"stage {s}: {n / 1e9:.3g}B" for s, n in p["largest"].items()))
    if "largest_states_only" in p:
        lines.append("model states only (the paper's Table 1): " +
                     ", ".join(f"stage {s}: {n / 1e9:.3g}B" for s, n in p["largest_states_only"].items()))
    return "\n".join(lines)
