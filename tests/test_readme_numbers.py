"""The numbers of README.md's measured tables are the results files' numbers, rounded as written: the TRL-trainer,
GRPO-step, longest-completion, fused-loss and SFT tables cell by cell against their suites' rows, and each row of a
whole-step table ("| system | step | rollout | ...") against a row, current or replaced, of the loop results it
cites."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
NUMBER = re.compile(r"(\d[\d,]*(?:\.\d+)?)\s*(ms|s|GiB|x)?(?![\w.])")

# A table by the start of its header row: the results files it quotes, the JSON fields a row's first cells pick
# (cell text -> value), the fields each later column picks, and the JSON field each unit of a cell's numbers quotes.
MODELS = {"Qwen2.5-1.5B": "qwen2.5-1.5b", "Llama-3.1-8B": "llama-3.1-8b"}
TRAINERS = {"`trl.GRPOTrainer`": "trl", "TRL, `use_liger_kernel=True`": "trl-liger", "`FastGRPOTrainer`": "fastgrpo",
            "`FastGRPOTrainer(offload_activations=True)`": "fastgrpo-offload"}
KEYED_TABLES = {
    "| model | mode | completion |": dict(
        files=("e2e_qwen2.5-1.5b-nvidia-h200.json", "e2e_llama-3.1-8b-nvidia-h200.json"),
        key=lambda cells: {"model": MODELS[cells[0]], "mode": {"LoRA": "lora16", "full": "full"}[cells[1]],
                           "completion_length": int(cells[2])},
        columns=[{"system": "hf"}, {"system": "liger"}, {"system": "fastgrpo"}],
        units={"ms": "ms", "GiB": "peak_gib"}),
    "| micro-batch | plain HF |": dict(
        files=("context_mb8-nvidia-h200.json", "context_mb1-nvidia-h200.json"),
        key=lambda cells: {"test": "longest_completion", "micro_batch": 8 if cells[0].startswith("all 8") else 1},
        columns=[{"system": "hf"}, {"system": "liger"}, {"system": "fastgrpo"}],
        units={None: "longest_completion", "GiB": "peak_gib"}),
    "| H | tokens |": dict(
        files=("fused_linear-nvidia-h200.json",),
        key=lambda cells: {"H": int(cells[0]), "tokens": int(cells[1].removesuffix("K")) * 1024},
        columns=[{"case": "eager"}, {"case": "liger"}, {"case": "ours_full"}, {"case": "ours_frozen"}],
        units={"ms": "ms", "x": "x_floor", "GiB": "peak_gib"}),
    "| mode | plain HF (logits + loss) |": dict(
        files=("sft-nvidia-h200.json",),
        key=lambda cells: {"mode": {"LoRA r=16": "lora16", "full": "full"}[cells[0]]},
        columns=[{"system": "hf"}, {"system": "hf+fused_ce"}, {"system": "liger"}, {"system": "fastgrpo"}],
        units={"ms": "ms", "s": "ms / 1000", "GiB": "peak_gib"}),
    "| trainer | 8 x 1024: step | peak |": dict(
        files=("trl-nvidia-h200.json",),
        key=lambda cells: {"system": TRAINERS[cells[0]]},
        columns=[{"completion": 1024}, {"completion": 1024}, {"completion": 4096}, {"completion": 4096}],
        units={"s": "step_s", "GiB": "peak_gib"}),
}
PHASE_TABLE = "| system | step | rollout | weight sync | log-probs | update | peak GiB |"
PHASES = ("step_s", "rollout_s", "sync_s", "logprobs_s", "update_s", "peak_gib")
LOOP_FILE = re.compile(r"results/(loop_[\w.-]+\.json)")


def tables(text: str) -> list[tuple[int, str, list[tuple[int, list[str]]]]]:
    """(line, header row, [(line, cells)] of its body) of each markdown table."""
    found, lines = [], text.splitlines()
    for n, line in enumerate(lines):
        if line.startswith("| ") and n + 1 < len(lines) and lines[n + 1].startswith("|---"):
            body = []
            for m in range(n + 2, len(lines)):
                if not lines[m].startswith("|"):
                    break
                body.append((m + 1, [cell.strip().replace("*", "") for cell in lines[m].strip("|").split("|")]))
            found.append((n + 1, line, body))
    return found


def numbers(cell: str) -> list[tuple[str, str | None]]:
    """(number as written, its unit: ms, s, GiB, x or None) of each number of a cell."""
    return [(m.group(1), m.group(2)) for m in NUMBER.finditer(cell)]


def rounds_to(value: float | None, written: str) -> bool:
    """`value` written as `written`: to its decimals, or to 3 significant figures (1028.2 as 1030)."""
    value = 0.0 if value is None else value  # a phase the system does not have (fastgrpo's weight sync)
    shown = float(written.replace(",", ""))
    decimals = len(written.partition(".")[2])
    return abs(value - shown) <= 0.5 * 10 ** -decimals + 1e-9 or float(f"{value:.3g}") == shown


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def field_value(row: dict, field: str) -> float | None:
    """A row's field, or a field over a divisor: `ms / 1000` for a table in seconds."""
    name, _, divisor = field.partition(" / ")
    return row.get(name) if not divisor or row.get(name) is None else row[name] / float(divisor)


def matching(rows: list[dict], fields: dict) -> list[dict]:
    return [row for row in rows if all(row.get(k) == v for k, v in fields.items())]


def keyed_table_errors(line: int, spec: dict, body: list) -> list[str]:
    rows = [row for name in spec["files"] for row in load(name)["rows"]]
    errors = []
    for n, cells in body:
        key = spec["key"](cells)
        for column, cell in zip(spec["columns"], cells[len(cells) - len(spec["columns"]):]):
            picked = matching(rows, key | column)
            if len(picked) != 1:
                errors.append(f"README.md:{n}: {len(picked)} rows of {spec['files']} are {key | column}")
                continue
            for written, unit in numbers(re.split(r"[(;] the search", cell)[0]):  # not the search's bound
                field = spec["units"].get(unit)
                value = field and field_value(picked[0], field)
                if field is None or not rounds_to(value, written):
                    errors.append(f"README.md:{n}: `{cell}`: {written} {unit or ''} is {field}={value} in "
                                  f"{'/'.join(spec['files'])} ({key | column})")
    return errors


def cited_loop_file(lines: list[str], line: int) -> str | None:
    """The loop results file last cited above a table, in its section."""
    start = next((n for n in range(line - 1, -1, -1) if lines[n].startswith("## ")), 0)
    cited = [m.group(1) for text in lines[start:line - 1] for m in LOOP_FILE.finditer(text)]
    return cited[-1] if cited else None


def phase_table_errors(lines: list[str], line: int, body: list) -> list[str]:
    """Each row's step, phases and peak are one row (current or in replaced_rows) of the cited loop file, or of any
    H200 loop file where the paragraph cites none."""
    name = cited_loop_file(lines, line)
    names = [name] if name else sorted(path.name for path in RESULTS.glob("loop_*-nvidia-h200.json"))
    rows = [row for n in names for result in [load(n)] for row in [*result["rows"], *result.get("replaced_rows", [])]
            if row.get("kind") == "step"]
    errors = []
    for n, cells in body:
        written = [numbers(cell)[0][0] if numbers(cell) else None for cell in cells[1:]]
        if not any(all(w is None or rounds_to(row.get(field), w) for field, w in zip(PHASES, written))
                   for row in rows):
            errors.append(f"README.md:{n}: no step row of {', '.join(names)} has {dict(zip(PHASES, written))}")
    return errors


def readme_number_errors(text: str) -> tuple[int, list[str]]:
    """(tables checked, errors)."""
    lines, checked, errors = text.splitlines(), 0, []
    for line, header, body in tables(text):
        spec = next((spec for start, spec in KEYED_TABLES.items() if header.startswith(start)), None)
        if spec:
            errors += keyed_table_errors(line, spec, body)
        elif header == PHASE_TABLE:
            errors += phase_table_errors(lines, line, body)
        else:
            continue
        checked += 1
    return checked, errors


def test_readme_tables_quote_the_results_files():
    checked, errors = readme_number_errors(README.read_text())
    assert checked >= len(KEYED_TABLES) + 4, f"only {checked} measured tables found in README.md"
    assert not errors, "README.md numbers the results files do not hold:\n" + "\n".join(errors)


@pytest.mark.parametrize("old, new, named", [
    ("| 1852 ms, 61.8 GiB |", "| 1852 ms, 61.3 GiB |", "61.3 GiB"),
    ("| 13.6 ms (1.20x), +0.80 GiB |", "| 13.6 ms (1.30x), +0.80 GiB |", "1.30 x"),
    ("| 1.71 s, 61.6 GiB |", "| 1.77 s, 61.6 GiB |", "1.77 s"),
    ("| 0.545 s | 5.39 GiB |", "| 0.545 s | 5.93 GiB |", "5.93 GiB"),
    ("| 73.0 s | 40.6 |", "| 73.0 s | 40.9 |", "'rollout_s': '40.9'"),
])
def test_a_wrong_readme_number_is_named_with_its_line(old, new, named):
    text = README.read_text()
    assert old in text, f"README.md no longer has {old!r}: pick another number to break"
    broken = text.replace(old, new, 1)
    _, errors = readme_number_errors(broken)
    assert len(errors) == 1 and named in errors[0], errors
    line = broken[:broken.index(new)].count("\n") + 1
    assert errors[0].startswith(f"README.md:{line}: "), errors
