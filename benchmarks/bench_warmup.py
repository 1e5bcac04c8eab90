"""How long the built-in engine's first rollout call takes, compiling the whole decode step or one decoder layer
(EngineConfig.compile_scope), with a cold and a warm on-disk compile cache; and what later calls recompile.

    python -m benchmarks.bench_warmup                   # GPU: both shapes x both scopes x cold/warm, < 4 min
    python -m benchmarks.bench_warmup --dry-run         # CPU: a tiny model, Inductor's C++ backend (the CPU proxy)
    python -m benchmarks.bench_warmup --shapes qwen2.5-1.5b --scopes layers --layers 8
    python -m benchmarks.bench_warmup --scopes layers --bytecode-cache /tmp/pyc   # as on a machine with .pyc files

Every measurement is a fresh process (python -m benchmarks.bench_warmup --child ...): the in-process caches of an
earlier one would otherwise make its first call look warm. `cold` runs on new, empty TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR; `warm` is a second process on the same directories (Inductor's FX graph and AOTAutograd caches
and Triton's kernel cache, all on by default: a restarted training run on the same machine). Dynamo's tracing is
not cached: a warm first call still traces.

The request is bench_rollout's (random-weight bf16 models of the Qwen2.5-1.5B and Llama-3.1-8B shapes, 8 prompts x
8 generations, temperature 1, EOS ignored) with 256 new tokens, on EngineConfig(attention="triton",
max_prompt_length=256, compile_scope=...). In each process, three calls with the same max_new_tokens:
  first    prompts of 256 tokens: compile + capture + 256 decode steps -> first_s
  second   prompts of 100 tokens (another cache bucket without max_prompt_length) -> second_s, new_frames
           (dynamo frames compiled during it: 0 expected) and captures (CUDA graphs captured: 1 per call)
  steady   the first call's request again -> steady_s; ready_s = first_s - steady_s is the first call's extra time
Columns: frames (dynamo frames the first call compiled), trace_s (dynamo's bytecode tracing), backend_s
(AOTAutograd + Inductor, cache lookups included), both from torch._dynamo.utils.compile_times; cpu_s: CPU seconds
of the first call, this process's and its exited children's (on a shared CPU less noisy than wall time; the dry
run compiles without a worker pool so that cpu_s sees all of it, on the GPU Triton's compile workers are missing
from it); ms_token = steady_s / new tokens (the prefill included: compare scopes with it, read per-step costs from
profile_rollout). Writes benchmarks/results/warmup-<card>.json (the dry run: in its temp dir).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from benchmarks.common import card_name, print_table, require_cuda, write_results

SHAPES = ("qwen2.5-1.5b", "llama-3.1-8b")
DRY_SHAPE = "tiny-qwen2"
SCOPES = ("layers", "step")  # in this order: if the deadline cuts the run, it cuts a step-scope row
# other_len: another cache bucket than prompt_len's without max_prompt_length; layers None: the shape's own
GPU_SIZES = dict(prompts=8, generations=8, prompt_len=256, other_len=100, new_tokens=256, layers=None)
DRY_SIZES = dict(prompts=2, generations=2, prompt_len=16, other_len=5, new_tokens=8, layers=4)
DEADLINE_S = 230  # the whole GPU run; a process that starts after it is skipped
CHILD_TIMEOUT_S = 120
COLUMNS = ["shape", "scope", "cache", "first_s", "ready_s", "cpu_s", "frames", "trace_s", "backend_s", "second_s",
           "new_frames", "captures", "steady_s", "ms_token"]


def child(shape: str, scope: str, dry: bool, layers: int | None, out: Path) -> None:
    """One process's three calls; the row goes to `out` as JSON."""
    from benchmarks.bench_rollout import build_model
    from benchmarks.e2e import MODEL_CONFIGS
    from fastgrpo.rollout.decode import EngineConfig
    from fastgrpo.rollout.generate import generate_with_config
    from fastgrpo.rollout.sampling import SamplingParams

    device = "cpu" if dry else "cuda"
    sizes = DRY_SIZES if dry else GPU_SIZES
    layers = layers or sizes["layers"]
    if layers:  # a variant of the shape with another depth
        MODEL_CONFIGS[shape] = {**MODEL_CONFIGS[shape], "num_hidden_layers": layers}
    model, tokenizer = build_model(shape, device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (sizes["prompts"], sizes["prompt_len"]), generator=g).tolist()
    other = [p[: sizes["other_len"]] for p in ids]
    # compile=True: also compiled on the CPU (the default compiles on CUDA only)
    config = EngineConfig(attention="triton", max_prompt_length=sizes["prompt_len"], compile_scope=scope,
                          compile=True)
    params = SamplingParams(max_new_tokens=sizes["new_tokens"], temperature=1.0)
    captures = []
    capture_begin = torch.cuda.CUDAGraph.capture_begin

    def counted_capture_begin(self, *args, **kwargs):
        captures.append(1)
        return capture_begin(self, *args, **kwargs)

    def call(prompts) -> float:
        _sync(device)
        start = time.perf_counter()
        result = generate_with_config(model, tokenizer, prompts, sizes["generations"], params, seed=0, config=config)
        _sync(device)
        assert result.completion_ids.shape == (len(prompts) * sizes["generations"], sizes["new_tokens"])
        return time.perf_counter() - start

    counters = torch._dynamo.utils.counters["stats"]
    with mock.patch.object(torch.cuda.CUDAGraph, "capture_begin", counted_capture_begin):
        cpu = _cpu_seconds()
        first = call(ids)
        cpu = _cpu_seconds() - cpu
        frames = counters["unique_graphs"]
        phases = _compile_times()
        first_captures = len(captures)
        second = call(other)
        row = {"first_s": first, "frames": frames, "first_captures": first_captures, "second_s": second,
               "new_frames": counters["unique_graphs"] - frames, "captures": len(captures) - first_captures}
        steady = call(ids)
    row.update(cpu_s=cpu, steady_s=steady, ready_s=first - steady, ms_token=steady / sizes["new_tokens"] * 1e3,
               trace_s=phases.get("bytecode_tracing"), backend_s=phases.get("OutputGraph.call_user_compiler"),
               layers=model.config.num_hidden_layers)
    out.write_text(json.dumps(row))


def _compile_times() -> dict[str, float]:
    """Seconds per dynamo compile phase so far, summed over frames ({} if this torch reports them otherwise)."""
    try:
        names, seconds = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
        return {name: float(s) for name, s in zip(names, seconds)}
    except Exception:  # noqa: BLE001 - a private API: the columns stay empty rather than the run failing
        return {}


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that have exited (the dry run's g++ calls)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_child(shape: str, scope: str, cache: str, cache_dir: Path, dry: bool, layers: int | None,
              timeout: float, bytecode_dir: Path | None = None) -> dict:
    """One measurement in a fresh process (its own session: a timeout also kills its compile workers). With
    bytecode_dir the process reads and writes Python bytecode there, whatever PYTHONDONTWRITEBYTECODE says."""
    row = {"shape": shape, "scope": scope, "cache": cache}
    if timeout < 20:
        return row | {"error": "skipped: global deadline reached"}
    out = cache_dir / f"row-{cache}.json"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir / "inductor"),
               TRITON_CACHE_DIR=str(cache_dir / "triton"))
    if bytecode_dir is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(bytecode_dir)
    if dry:  # no compile worker pool: every compile is this process's work or an exited g++'s, so cpu_s sees it
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    cmd = [sys.executable, "-m", "benchmarks.bench_warmup", "--child", f"{shape},{scope}", "--out", str(out)]
    cmd += (["--dry-run"] if dry else []) + ([f"--layers={layers}"] if layers else [])
    proc = subprocess.Popen(cmd, cwd=Path(__file__).parents[1], env=env, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return row | {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode or not out.exists():
        return row | {"error": f"subprocess exited with {proc.returncode}"}
    return row | json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    parser.add_argument("--scopes", default=",".join(SCOPES), help="comma-separated, of " + ", ".join(SCOPES))
    parser.add_argument("--layers", type=int, help="override the shapes' number of layers (dry run: 4)")
    parser.add_argument("--bytecode-cache", type=lambda p: Path(p).resolve(), metavar="DIR",
                        help="children keep Python bytecode in DIR (PYTHONPYCACHEPREFIX), primed by one unrecorded "
                             "cold child first: a machine whose packages carry .pyc, as pip installs them. Without it "
                             "children inherit this environment (a machine with PYTHONDONTWRITEBYTECODE=1 and no .pyc "
                             "compiles the source of every module the first torch.compile imports, inside the first "
                             "call)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: "shape,scope", measured in this process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        shape, scope = args.child.split(",")
        child(shape, scope, args.dry_run, args.layers, Path(args.out))
        return
    scopes = args.scopes.split(",")
    if set(scopes) - set(SCOPES):
        parser.error(f"--scopes: expected some of {', '.join(SCOPES)}")
    if not args.dry_run:
        require_cuda(parser)
    work = Path(tempfile.mkdtemp(prefix="rollout_warmup_"))
    print(f"compile caches and per-process rows: {work}", flush=True)
    deadline = time.monotonic() + (float("inf") if args.dry_run else DEADLINE_S)
    rows = []
    shapes = [DRY_SHAPE] if args.dry_run else args.shapes.split(",")
    if args.bytecode_cache:
        prime = work / "prime"
        prime.mkdir()
        primed = run_child(shapes[0], scopes[0], "cold", prime, args.dry_run, args.layers, CHILD_TIMEOUT_S,
                           args.bytecode_cache)
        if "error" in primed:  # the rows would then pay for the bytecode they are said to have
            parser.error(f"--bytecode-cache: the priming child failed ({primed['error']}); nothing measured")
    for shape in shapes:
        for scope in scopes:
            cache_dir = work / f"{shape}-{scope}"
            cache_dir.mkdir()
            for cache in ("cold", "warm"):
                timeout = min(CHILD_TIMEOUT_S, deadline - time.monotonic()) if not args.dry_run else 1800
                rows.append(run_child(shape, scope, cache, cache_dir, args.dry_run, args.layers, timeout,
                                      args.bytecode_cache))
                print(json.dumps(rows[-1]), flush=True)
    sizes = DRY_SIZES if args.dry_run else GPU_SIZES
    config = {"model": "random weights, bf16", "card": card_name(), **sizes, "layers": args.layers or sizes["layers"],
              "sampling": "temperature 1, EOS ignored",
              "engine": "EngineConfig(attention='triton', max_prompt_length=prompt_len, compile_scope=scope)",
              "bytecode": {"cache": str(args.bytecode_cache) if args.bytecode_cache else None,
                           "inherited_PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE")}}
    path = write_results("warmup", rows, config, work if args.dry_run else None)
    print(f"\nwrote {path}")
    for row in rows:
        if "error" in row:
            print(f"{row['shape']} {row['scope']} {row['cache']}: {row['error']}")
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
