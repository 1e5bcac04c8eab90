"""The console of a run: one plain line every `every` steps, readable in a terminal and in a log file alike.

    step 10/100 | reward 0.253 | loss -0.0093 | kl 0 | entropy 2.31 | clip_ratio 0 | completion_length 8.0 |
    rollout_tokens_per_s 9.1K | train_tokens_per_s 35K | step_s 0.12 | peak RSS 0.41 GiB     (one line, cut here)

Each label is the name of the metric in metrics.jsonl (a user finds the console's numbers there under the same
names): `fastgrpo ei`'s line shows its round's sft_loss_last, not a "loss" it does not log. Each line holds the
means over the steps since the previous line (peak_gpu_mem_gib: their maximum; on the CPU, where that is 0, the
process's peak resident memory, "peak RSS", which metrics.jsonl does not hold). A tqdm bar runs between the lines
only when stderr is a terminal or a Jupyter notebook's output (in a file its redraws make one line of many
kilobytes).
Another command's loop uses it the same way: `console = ConsoleLog(every, total)`, `console.add(metrics)` once per
step with the keys it has (missing ones are left out of the line), `console.close()` at the end; a loop that counts
rounds, not steps, passes unit="round" and its metrics carry "round" (expert iteration).
"""
from __future__ import annotations

import resource
import sys
import warnings
from pathlib import Path

# (metrics key, format), the key shown as the label; in this order, each where the window's metrics have it
_FIELDS = (
    ("reward", "{:.3f}"),
    ("loss", "{:.4g}"),
    ("sft_loss_last", "{:.4g}"),  # ei: its round's last SFT step's
    ("kept_frac", "{:.3f}"),  # ei
    ("kl", "{:.3g}"),
    ("entropy", "{:.3g}"),
    ("clip_ratio", "{:.3g}"),
    ("completion_length", "{:.1f}"),
    ("eval/accuracy", "{:.3f}"),  # the periodic evaluation's, on the steps it ran (--eval-steps)
    ("rollout_tokens_per_s", "si"),
    ("train_tokens_per_s", "si"),
    ("tokens_per_s", "si"),  # sft
    ("step_s", "{:.3g}"),
)


class ConsoleLog:
    def __init__(self, every: int, total: int, *, initial: int = 0, progress_bar: bool = True, stream=None,
                 unit: str = "step"):
        self.every, self.total, self.unit = every, total, unit
        self.stream = stream if stream is not None else sys.stdout
        self._window: list[dict] = []
        self._bar = None
        if progress_bar and _redraws_in_place(sys.stderr):
            from tqdm import TqdmWarning

            with warnings.catch_warnings():  # a notebook without ipywidgets gets tqdm's text bar, not its warning
                warnings.simplefilter("ignore", TqdmWarning)
                from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="fastgrpo", leave=False)

    def add(self, metrics: dict) -> None:
        """Take one step's metrics; print a line every `every` steps and at the last step."""
        if self._bar is not None:
            self._bar.update(1)
        if not self.every:
            return
        self._window.append(metrics)
        step = metrics.get(self.unit, 0)
        if step % self.every == 0 or step >= self.total:
            self.print(_line(self._window, self.total, self.unit))
            self._window = []

    def print(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _redraws_in_place(stream) -> bool:
    """A terminal, or a Jupyter kernel's stream, whose isatty() is False but whose front end redraws a bar in place
    (tqdm.auto draws a widget there when ipywidgets is installed)."""
    return stream.isatty() or type(stream).__module__.startswith("ipykernel.")


def number(value: float | None, fmt: str = "{:.3f}") -> str:
    """A metric in a summary line: `fmt` of it, or "none" where nothing was measured (a step whose completions no
    reward function scored logs reward null)."""
    return "none" if value is None else fmt.format(value)


def change(key: str, first: dict, last: dict, unit: str = "step", fmt: str = "{:.3f}") -> str:
    """A run's closing summary of metric `key`: "reward 0.044 (step 1) -> 0.253 (step 40)" from its first and last
    logged metrics; "reward 0.044 (step 3)" for a run of one step (or round)."""
    start = f"{key} {number(first[key], fmt)} ({unit} {first[unit]})"
    return start if first[unit] == last[unit] else f"{start} -> {number(last[key], fmt)} ({unit} {last[unit]})"


def run_files(output_dir: str, exported: bool) -> str:
    """Where a run's closing line says its files went: "metrics in run/metrics.jsonl, model in run/final" (the model
    where the run exported it; its checkpoints are beside them)."""
    folder = Path(output_dir)
    model = f", model in {folder / 'final'}" if exported and (folder / "final").is_dir() else ""
    return f"metrics in {folder / 'metrics.jsonl'}{model}"


def _mean(window: list[dict], key: str) -> float | None:
    values = [m[key] for m in window if isinstance(m.get(key), (int, float))]
    return sum(values) / len(values) if values else None


def _line(window: list[dict], total: int, unit: str = "step") -> str:
    parts = [f"{unit} {window[-1].get(unit, '?')}/{total}"]
    for key, fmt in _FIELDS:
        value = _mean(window, key)
        if value is not None:
            parts.append(f"{key} {_si(value) if fmt == 'si' else fmt.format(value)}")
    parts.append(_peak_memory(window))
    return " | ".join(parts)


def _peak_memory(window: list[dict]) -> str:
    gpu = max((m.get("peak_gpu_mem_gib", 0.0) for m in window), default=0.0)
    if gpu > 0:
        return f"peak_gpu_mem_gib {gpu:.2f}"
    # On the CPU the process's peak resident memory (ru_maxrss is in KiB on Linux), a number metrics.jsonl lacks
    return f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"


def _si(value: float) -> str:
    shown = float(f"{value:.3g}")  # the unit of the value as 3 digits show it: 999.7 is 1K (.3g wrote 1e+03)
    for unit, scale in (("M", 1e6), ("K", 1e3)):
        if shown >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"
