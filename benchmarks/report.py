"""Render benchmarks/results/*.json into one markdown report and PNG charts.

    python -m benchmarks.report    # writes benchmarks/results/REPORT.md, one e2e_*.png per e2e suite, one per loop file
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"


def _fmt(value) -> str:
    """A cell: a float to 3 significant digits, or as a whole number from 1,000 on (no exponent either way, but for
    |value| < 1e-4: an error of 1.2e-08 reads better so)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        # from 999.5 on, 3 significant digits round to 1000, which .3g writes as 1e+03
        return f"{value:,.3g}" if abs(value) < 999.5 else f"{value:,.0f}"
    return str(value)


def markdown_table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(results: list[dict]) -> str:
    parts = ["# fastgrpo benchmark report", ""]
    for result in results:
        versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
        parts += [f"## {result['suite']} — {result['card']} ({result['date']})", "", f"Versions: {versions}", ""]
        if result.get("config"):
            parts += ["Config: " + ", ".join(f"{k}={v}" for k, v in result["config"].items()), ""]
        fits = [row for row in result["rows"] if row.get("kind") == "max_fit"]
        rows = [row for row in result["rows"] if row.get("kind") != "max_fit"]
        parts += [markdown_table(rows), ""] if rows else []
        parts += ["Longest completion in the cap (bench_loop --max-fit):", "", markdown_table(
            [max_fit_summary(row) for row in fits]), ""] if fits else []
        parts += ["Targets (2x TRL, 1.3x Unsloth, at no more peak memory; benchmarks/loop_targets.py):", "",
                  markdown_table([target_summary(t) for t in result["targets"]]), ""] if result.get("targets") else []
    return "\n".join(parts)


def target_summary(target: dict) -> dict:
    """A loop file's verdict with its peaks and phase ratios as one cell each."""
    peaks, phases = target.get("peak_gib"), target.get("phases") or {}
    return {**{k: target.get(k) for k in ("completion", "baseline", "target", "fastgrpo", "speedup", "met",
                                          "same_machine", "speedup_same_machine")},
            "peak_gib (fastgrpo / baseline)": peaks and f"{_fmt(peaks['fastgrpo'])} / {_fmt(peaks['baseline'])}",
            "phase speed-ups": ", ".join(f"{k.removesuffix('_s')} {_fmt(v)}x" for k, v in phases.items()),
            "why": target.get("why")}


def max_fit_summary(row: dict) -> dict:
    """A max_fit row with its probes as one cell: completion, verdict and NVML peak each."""
    def verdict(probe: dict) -> str:
        return "fits" if probe.get("fits") else "out of memory" if probe.get("out_of_memory") else "error"

    probes = "; ".join(f"{p['completion']}: {verdict(p)}, {_fmt(p.get('peak_gib'))} GiB" for p in row["probes"])
    return {"system": row["system"], "cap_gib": row.get("cap_gib"), "max_completion": row.get("max_completion"),
            "first_failure": row.get("first_failure"), "searched_to": row.get("searched_to"),
            "complete": row.get("complete"), "probes": probes, "note": row.get("note")}


def render_e2e_chart(result: dict, path: Path) -> None:
    """Step time and peak memory against completion length: a colour per system, a line style per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[tuple, list[dict]] = {}
    for row in result["rows"]:
        series.setdefault((row["model"], row["mode"], row["system"]), []).append(row)
    colours = {"hf": "tab:orange", "liger": "tab:green", "fastgrpo": "tab:blue"}
    for (model, mode, system), rows in sorted(series.items()):
        rows = sorted((r for r in rows if r.get("ms") is not None), key=lambda r: r["completion_length"])
        if not rows:
            continue
        x = [r["completion_length"] for r in rows]
        style = dict(marker="o", color=colours.get(system), linestyle="--" if mode == "full" else "-",
                     label=f"{system} ({model}, {mode})")
        ax_time.plot(x, [r["ms"] / 1e3 for r in rows], **style)
        ax_mem.plot(x, [r["peak_gib"] for r in rows], **style)
    for ax, ylabel in ((ax_time, "step time (s)"), (ax_mem, "peak memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("completion length (tokens, 8 generations)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_mem.axhline(24, color="grey", linestyle="--", linewidth=1)
    ax_time.legend(fontsize=7)
    fig.suptitle(f"GRPO training step, {result['card']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


LOOP_PHASES = ("rollout_s", "sync_s", "logprobs_s", "rewards_s", "update_s")


def render_loop_chart(result: dict, path: Path) -> None:
    """One whole GRPO step per system and completion length: a bar stacked by phase, peak memory on the label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((r for r in result["rows"] if r.get("kind") == "step" and r.get("step_s")),
                  key=lambda r: (r["completion"], r["step_s"]))
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    labels = [f"{r['system']} ({r['completion']}), {r['peak_gib']:.1f} GiB" for r in rows]
    left = [0.0] * len(rows)
    for phase in LOOP_PHASES:
        widths = [r.get(phase) or 0.0 for r in rows]
        ax.barh(labels, widths, left=left, label=phase.removesuffix("_s"))
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds per GRPO step")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, ncol=len(LOOP_PHASES), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.suptitle(f"{result['suite']}, {result['card']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv: list[str] | None = None) -> None:
    # no options yet; --help must describe the run, not start it (it rewrote REPORT.md and the charts)
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    paths = sorted(RESULTS_DIR.glob("*.json"))
    results = [json.loads(p.read_text()) for p in paths]
    (RESULTS_DIR / "REPORT.md").write_text(render_markdown(results))
    for path, result in zip(paths, results):
        if result["suite"].startswith("e2e"):
            render_e2e_chart(result, RESULTS_DIR / f"{result['suite']}.png")
        if result["suite"].startswith("loop_"):  # one chart per card: the same shape runs on H100s and H200s
            render_loop_chart(result, path.with_suffix(".png"))
    print(f"wrote {RESULTS_DIR / 'REPORT.md'} from {len(results)} result files")


if __name__ == "__main__":
    main()
