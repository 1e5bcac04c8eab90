"""The numbers of README.md's measured tables are the results files' numbers, rounded as written: the TRL-trainer,
GRPO-step, longest-completion, fused-loss and SFT tables cell by cell against their suites' rows, each row of a
whole-step table ("| system | step | rollout | ...") against a row, current or replaced, of the loop results it
cites, and the table of where each shape stands against the targets against the loop files' "targets" verdicts."""
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
# where each shape stands against the targets (H200; C = 1024 unless its shape cell says "C = ...")
TARGETS_TABLE = "| shape | fastgrpo vs TRL + vLLM | vs Unsloth | peak: fastgrpo / TRL / Unsloth GiB | targets |"
BASELINES = {"TRL + Liger": "trl-liger", "TRL": "trl", "Unsloth": "unsloth"}
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


def claimed_verdicts(text: str) -> dict[str, bool | None]:
    """Baseline -> met, as a targets cell words it: clauses split at commas and semicolons, parentheses left out, "not"
    in a clause for not met; a clause naming no baseline speaks for every baseline no clause names, TRL's for TRL +
    Liger where no clause names that."""
    claims, rest = {}, None
    for clause in re.split(r"[,;]", re.sub(r"\([^)]*\)", "", text)):
        named = [BASELINES[name] for name in re.findall("|".join(map(re.escape, BASELINES)), clause)]
        met = "not" not in clause.split()
        claims |= dict.fromkeys(named, met)
        rest = rest if named else met
    if "trl" in claims:
        claims.setdefault("trl-liger", claims["trl"])
    return {baseline: claims.get(baseline, rest) for baseline in BASELINES.values()}


def targets_table_errors(body: list) -> list[str]:
    """Each shape's verdicts are its H200 loop file's "targets": the words met / not met per baseline, TRL's ratio
    (the verdict's, or against the row of TRL's own machine), the chosen fastgrpo row's peak and TRL's and Unsloth's."""
    errors = []
    for n, (shape, trl, _, peaks, claim) in body:
        model, mode = shape.split(",")[0].split()[:2]
        completion = int(found.group(1)) if (found := re.search(r"C = (\d+)", shape)) else 1024
        name = f"loop_{MODELS[model]}-{mode.lower()}-nvidia-h200.json"
        verdicts = {t["baseline"]: t for t in load(name)["targets"] if t["completion"] == completion}
        where = f"README.md:{n}: {shape}: "
        for baseline, met in claimed_verdicts(claim).items():
            held = verdicts.get(baseline, {}).get("met")
            if held is not None and met is not held:
                errors.append(f"{where}`{claim}` says {baseline} {'met' if met else 'not met'}; {name}: met={held}")
        quoted = [verdicts["trl"][k] for k in ("speedup", "speedup_same_machine") if verdicts["trl"][k] is not None]
        if not any(unit == "x" and rounds_to(v, w) for v in quoted for w, unit in numbers(trl)):
            errors.append(f"{where}`{trl}` quotes neither of TRL's ratios {quoted} in {name}")
        ours, *theirs = peaks.split(" / ")
        if not any(rounds_to(verdicts["trl"]["peak_gib"]["fastgrpo"], w) for w, _ in numbers(ours)):
            errors.append(f"{where}`{ours}` lacks the peak {verdicts['trl']['peak_gib']['fastgrpo']} of "
                          f"{verdicts['trl']['fastgrpo']} in {name}")
        for baseline, cell in zip(("trl", "unsloth"), theirs):
            held = verdicts.get(baseline, {}).get("peak_gib", {}).get("baseline")
            written = numbers(cell)[0][0] if numbers(cell) else None
            if (held is None) != (written is None) or written is not None and not rounds_to(held, written):
                errors.append(f"{where}`{cell}` is {baseline}'s peak_gib {held} in {name}")
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
        elif header == TARGETS_TABLE:
            errors += targets_table_errors(body)
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
    ("| 1024 | 7680 |", "| 1024 | 7936 |", "7936"),
    ("| 40.5 s | 22.4 | 0.27 |", "| 40.5 s | 22.7 | 0.27 |", "'rollout_s': '22.7'"),  # not a table's first row
    ("| 22.9 s | 14.5 | 0 |", "| 22.9 s | 14.5 | 0.3 |", "'sync_s': '0.3'"),  # a field fastgrpo's row lacks
    ("| met against TRL, not against TRL + Liger |", "| met against TRL and TRL + Liger |",
     "says trl-liger met"),
    ("| Unsloth met with FP8 rollouts", "| Unsloth not met with FP8 rollouts", "says unsloth not met"),
    ("| **2.32x** |", "| **2.23x** |", "quotes neither of TRL's ratios"),
    ("| 9.2 / 12.5 / 16.6 |", "| 9.2 / 12.5 / 16.9 |", "`16.9` is unsloth's peak_gib 16.6"),
    ("| 33.4 / 53.5 / 111.4 |", "| 34.4 / 53.5 / 111.4 |", "lacks the peak 33.4 of fastgrpo-fp8"),
])
def test_a_wrong_readme_number_is_named_with_its_line(old, new, named):
    text = README.read_text()
    assert old in text, f"README.md no longer has {old!r}: pick another number to break"
    broken = text.replace(old, new, 1)
    _, errors = readme_number_errors(broken)
    assert len(errors) == 1 and named in errors[0], errors
    line = broken[:broken.index(new)].count("\n") + 1
    assert errors[0].startswith(f"README.md:{line}: "), errors


def test_a_search_bound_is_not_taken_for_a_measured_length():
    """"(...; the search stopped at N)": N is where the search ended, not a length the file measured."""
    assert readme_number_errors(README.read_text().replace("stopped at 32K", "stopped at 40960"))[1] == []


def test_a_cell_that_two_rows_could_quote_is_named(monkeypatch):
    """A results file holding the same case twice: which row a number quotes is not known."""
    monkeypatch.setitem(globals(), "load", lambda name: {"rows": [{"system": "hf", "ms": 10.0}] * 2})
    spec = dict(files=("twice.json",), key=lambda cells: {}, columns=[{"system": "hf"}], units={"ms": "ms"})
    assert keyed_table_errors(1, spec, [(7, ["10.0 ms"])]) == ["README.md:7: 2 rows of ('twice.json',) are "
                                                               "{'system': 'hf'}"]


def test_a_whole_step_row_quotes_the_file_its_paragraph_cites():
    """A row of the Llama file's numbers under a paragraph citing the Qwen file is named."""
    llama = "loop_llama-3.1-8b-lora-nvidia-h200.json"
    row = next(r for r in load(llama)["rows"] if r.get("kind") == "step" and r.get("step_s"))
    cells = ["0" if row.get(field) is None else f"{row[field]:.3g}" for field in PHASES]
    table = [PHASE_TABLE, "|---|---|---|---|---|---|---|", "| a system | " + " | ".join(cells) + " |"]
    for cited, errors in ((llama, 0), ("loop_qwen2.5-1.5b-lora-nvidia-h200.json", 1)):
        text = "\n".join(["## Whole steps", f"Rows of `benchmarks/results/{cited}`:", "", *table])
        assert len(readme_number_errors(text)[1]) == errors, (cited, table)
