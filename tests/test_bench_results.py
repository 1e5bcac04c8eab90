"""benchmarks.common.write_results keeps the record: a run on the same card adds to a results file, its earlier runs
stay under "earlier_runs", and a suite that writes after every row does not nest its own partial writes; a
misspelt name on a benchmark's command line is refused before anything runs or is written."""
import json

import pytest

from benchmarks import common


def test_a_second_run_keeps_the_first(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "card_name", lambda: "Test Card 9")
    monkeypatch.setattr(common, "_EARLIER_RUNS", {})
    path = common.write_results("suite", [{"case": "a", "ms": 1.0}], {"note": "first"}, tmp_path)
    assert path.name == "suite-test-card-9.json"
    common.write_results("suite", [{"case": "a", "ms": 1.0}, {"case": "b", "ms": 2.0}], {"note": "first"}, tmp_path)
    first = json.loads(path.read_text())
    assert first["earlier_runs"] == [] and len(first["rows"]) == 2  # the same process: its partial writes replaced

    monkeypatch.setattr(common, "_EARLIER_RUNS", {})  # a later process
    common.write_results("suite", [{"case": "a", "ms": 0.5}], {"note": "second"}, tmp_path)
    monkeypatch.setattr(common, "_EARLIER_RUNS", {})
    common.write_results("suite", [{"case": "a", "ms": 0.4}], {"note": "third"}, tmp_path)
    third = json.loads(path.read_text())
    assert third["rows"] == [{"case": "a", "ms": 0.4}] and third["config"] == {"note": "third"}
    assert [run["config"]["note"] for run in third["earlier_runs"]] == ["first", "second"]
    assert third["earlier_runs"][0]["rows"] == first["rows"] and "earlier_runs" not in third["earlier_runs"][0]


def test_a_file_without_a_record_of_runs_becomes_the_first(tmp_path, monkeypatch):
    """Files written before earlier_runs existed (no such key) become its first entry, hand-added config included."""
    monkeypatch.setattr(common, "card_name", lambda: "Card")
    monkeypatch.setattr(common, "_EARLIER_RUNS", {})
    old = {"suite": "s", "card": "Card", "date": "2026-01-01", "versions": {"torch": "2.11"},
           "config": {"later_runs": [{"rows": []}]}, "rows": [{"x": 1}]}
    (tmp_path / "s-card.json").write_text(json.dumps(old))
    path = common.write_results("s", [{"x": 2}], {}, tmp_path)
    want = {"date": "2026-01-01", "versions": {"torch": "2.11"}, "config": {"later_runs": [{"rows": []}]},
            "rows": [{"x": 1}]}
    assert json.loads(path.read_text())["earlier_runs"] == [want]


def test_an_unreadable_file_is_moved_aside_not_overwritten(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "card_name", lambda: "Card")
    monkeypatch.setattr(common, "_EARLIER_RUNS", {})
    (tmp_path / "s-card.json").write_text('{"rows": [{"x": 1}]')  # cut off mid-write
    path = common.write_results("s", [{"x": 2}], {}, tmp_path)
    (aside,) = tmp_path.glob("s-card.json.unreadable-*")
    assert aside.read_text() == '{"rows": [{"x": 1}]'
    assert json.loads(path.read_text())["earlier_runs"] == [{"unreadable_file_moved_to": aside.name}]


@pytest.mark.parametrize("module, flag", [("bench_fp8", "--shapes"), ("bench_fp8", "--modes"),
                                          ("profile_rollout", "--shapes"), ("profile_rollout", "--modes"),
                                          ("bench_rollout_lengths", "--shapes"), ("bench_rollout_lengths", "--modes"),
                                          ("bench_decode_attention", "--shapes"),
                                          ("bench_decode_attention", "--caches")])
def test_an_unknown_name_is_one_line_and_writes_nothing(module, flag, capsys, tmp_path, monkeypatch):
    """A misspelt shape, mode or cache: the parser's one-line error naming the flag (exit 2) before any run, and no
    results file (profile_rollout once wrote rollout_profile-cpu.json for an unknown shape)."""
    import importlib

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    with pytest.raises(SystemExit) as done:
        importlib.import_module(f"benchmarks.{module}").main([flag, "nope"])
    assert done.value.code == 2
    assert f"{flag}: unknown ['nope']" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("flag, value, expected", [("--prompts", "0", "expected >= 1"),
                                                   ("--new-tokens", "100", "expected a multiple of 16"),
                                                   ("--new-tokens", "520", "expected a multiple of 16")])
def test_profile_rollout_refuses_sizes_it_cannot_profile(flag, value, expected, capsys, tmp_path, monkeypatch):
    """A rollout length off the engine's 16-step host syncs (or too short for a window at its middle) or no rows:
    the parser's one line naming the flag, before any model is built, and no results file."""
    from benchmarks import profile_rollout

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    with pytest.raises(SystemExit) as done:
        profile_rollout.main([flag, value])
    assert done.value.code == 2
    assert f"{flag}: {expected}" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_profile_rollout_sizes_change_only_what_is_asked():
    from benchmarks.profile_rollout import GPU_SIZES, sizes_for

    assert sizes_for(False, None) == GPU_SIZES
    long = sizes_for(False, None, 4096)
    assert (long.new_tokens, long.prompts, long.mean_context, long.profile_from) == (4096, 8, 256 + 2048, 2048 - 16)
    assert sizes_for(False, 4, 2048) == type(GPU_SIZES)(**{**GPU_SIZES.__dict__, "prompts": 4, "new_tokens": 2048})


def test_decode_attention_bench_times_both_layouts_with_the_kernels_own_tiles(capsys, tmp_path, monkeypatch):
    """--layouts plain,shared on the CPU (dry run): a row per layout, each with the tiles the kernel picks for its
    programs (a shared prefix's S x G rows), the same output as those tiles give, and no results file."""
    from benchmarks import bench_decode_attention as bench
    from fastgrpo.kernels.decode_attention import GPU_TILES, tiles_for

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    bench.main(["--dry-run", "--shapes", "llama-3.1-8b", "--caches", "e4m3-fp8-dots", "--layouts", "plain,shared"])
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("llama")]
    assert [line[2] for line in lines] == ["plain", "shared"], lines
    default, diff = bench.COLUMNS.index("default"), bench.COLUMNS.index("max_diff_vs_default")
    assert all(line[default] == "True" and line[diff] == "0" for line in lines), lines  # default tiles, max_diff 0
    S, G = bench.DRY_SIZES["samples"], bench.heads("llama-3.1-8b")[1]
    # 8 x 4 rows: GPU_TILES over an e4m3 cache, smaller tiles over a bf16 one (twice the bytes)
    assert bench.kernel_tiles("llama-3.1-8b", bench.GPU_SIZES, "e4m3", "shared") is GPU_TILES
    assert bench.kernel_tiles("llama-3.1-8b", bench.GPU_SIZES, "bf16", "shared") == tiles_for(8 * G, 128) != GPU_TILES
    assert bench.kernel_tiles("llama-3.1-8b", bench.DRY_SIZES, "e4m3", "shared") == tiles_for(max(16, S * G), 128, True)
    assert not list(tmp_path.iterdir())



def test_quantize_bench_times_own_before_and_swept_tiles_that_give_the_same_bytes(capsys, tmp_path, monkeypatch):
    """bench_quantize --dry-run: per case the kernel's own tiles, the tiles before them (two passes) and the sweep's,
    each giving the own tiles' bytes, and no results file; on the GPU's cases each swept tile once."""
    from benchmarks import bench_quantize as bench
    from fastgrpo.kernels.quantize_fp8 import quantize_tiles

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    bench.main(["--dry-run"])
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("dry-")]
    column = {name: bench.COLUMNS.index(name) for name in bench.COLUMNS}
    for case, (_, K, _) in bench.DRY_CASES.items():
        rows = [line for line in lines if line[column["case"]] == case]
        labels = [line[column["tiles"]] for line in rows]
        assert labels[:2] == ["own", "before"] and set(labels[2:]) == {"sweep"}, labels
        assert all(line[column["same_bytes"]] == "True" for line in rows), rows
        assert rows[0][column["one_pass"]] == str(quantize_tiles(K).one_pass), rows[0]
        assert rows[1][column["one_pass"]] == "False", rows[1]
    assert not list(tmp_path.iterdir())
    for _, K, _ in bench.CASES.values():  # the sweep's tiles once each, without the own tiles (which it can hold)
        (_, own), (_, before), *swept = bench.candidates(K, sweep=True)
        swept = [tiles for _, tiles in swept]
        assert len(set(swept)) == len(swept) and not {own, before} & set(swept), (K, own, before, swept)


def test_quantize_bench_shows_a_tile_that_writes_nothing(capsys, monkeypatch):
    """A tile whose launch writes nothing is not the own tiles' bytes: the outputs it is checked in held them from the
    own tiles' call (the `same_bytes` of any tile was True)."""
    from benchmarks import bench_quantize as bench
    from fastgrpo.kernels.quantize_fp8 import QuantizeTiles

    launch = bench.quantize_rows_fwd
    idle = QuantizeTiles(2, 64, True, 8)  # its launch is skipped below: a kernel that writes no row for it

    def launch_unless_idle(x, q, scale, column_scale=None, tiles=None):
        if tiles != idle:
            launch(x, q, scale, column_scale, tiles)

    monkeypatch.setattr(bench, "quantize_rows_fwd", launch_unless_idle)
    monkeypatch.setattr(bench, "sweep_tiles", lambda K: [idle])
    rows = bench.run_case("dry-idle", 3, 40, False, "cpu", None, sweep=True)
    assert [(row["tiles"], row["same_bytes"]) for row in rows] == [("own", True), ("before", True), ("sweep", False)]


def test_decode_attention_bench_parses_tiles_and_sizes_a_longer_rollout():
    """--tiles' block_n/num_warps/num_stages[/maxnreg] in that order, nothing else; --new-tokens N: a cache of
    256 + N slots filled to the mean context 256 + N / 2 (GPU_SIZES is N = 1024's)."""
    from benchmarks import bench_decode_attention as bench

    assert bench.parse_tiles("64/2/3") == dict(block_n=64, num_warps=2, num_stages=3)
    assert bench.parse_tiles("128/4/2/168") == dict(block_n=128, num_warps=4, num_stages=2, maxnreg=168)
    for text in ("64/2", "128/4/2/168/1", "64/two/2"):
        with pytest.raises(ValueError):
            bench.parse_tiles(text)
    assert bench.rollout_sizes(bench.NEW_TOKENS) == bench.GPU_SIZES
    assert bench.rollout_sizes(4096) == bench.GPU_SIZES | dict(slots=256 + 4096, length=256 + 2048)


@pytest.mark.parametrize("argv, expected", [
    (["--dry-run", "--new-tokens", "1"], "--new-tokens: expected an integer >= 2; got 1"),
    (["--dry-run", "--new-tokens", "4096"], "--new-tokens: the dry run has its own tiny sizes; leave it out there"),
    (["--dry-run", "--tiles", "64/2"], "--tiles: expected block_n/num_warps/num_stages[/maxnreg], comma-separated"),
])
def test_decode_attention_bench_refuses_sizes_and_tiles_in_one_line(argv, expected, capsys, tmp_path, monkeypatch):
    from benchmarks import bench_decode_attention as bench

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    with pytest.raises(SystemExit) as done:
        bench.main(argv)
    assert done.value.code == 2
    assert expected in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_decode_attention_bench_times_the_new_tokens_rollout_with_its_cards_tiles(monkeypatch):
    """Off the CPU (CUDA and the timing stubbed): the shapes run at --new-tokens' sizes, with the tiles the kernel
    takes on that card (fp8_dots' plain programs: a third stage on a card with the room), which the results file's
    config names (it named GPU_TILES alone)."""
    from benchmarks import bench_decode_attention as bench
    from fastgrpo.kernels.decode_attention import FP8_DOTS_DEEP_TILES, GPU_TILES

    runs = []
    monkeypatch.setattr(bench, "check_interpreted", lambda parser, dry_run: None)
    monkeypatch.setattr(bench, "require_cuda", lambda parser: None)
    monkeypatch.setattr(bench, "_copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(bench, "run_shape", lambda shape, sizes, *rest: runs.append((shape, sizes)) or [])
    written = []
    monkeypatch.setattr(bench, "write_results", lambda name, rows, config: written.append(config) or "nowhere")
    bench.main(["--shapes", "llama-3.1-8b", "--no-sweep", "--new-tokens", "4096"])
    assert runs == [("llama-3.1-8b", bench.rollout_sizes(4096))]
    (config,) = written
    assert config["sizes"] == bench.rollout_sizes(4096) and str(FP8_DOTS_DEEP_TILES) in config["default_tiles"]
    hopper = 227 * 1024
    assert bench.kernel_tiles("llama-3.1-8b", bench.GPU_SIZES, "e4m3-fp8-dots", "plain", hopper) is FP8_DOTS_DEEP_TILES
    assert bench.kernel_tiles("llama-3.1-8b", bench.GPU_SIZES, "e4m3-fp8-dots", "plain", 99 * 1024) is GPU_TILES
