"""Test set-up: without CUDA, Triton kernels run on the CPU through its interpreter.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so this runs before fastgrpo's kernels
are imported. GPU-marked tests are skipped with a reason when CUDA is absent.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers share the cores: a worker's torch threads beyond its share would wait on the others'
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))


def _define_every_kernel() -> None:
    """Import every fastgrpo.kernels module now, so each @triton.jit is defined under the interpreter: a test that
    unsets TRITON_INTERPRET for a while (test_readme runs a user's session, test_adamw the eager twin) and imports a
    kernel module first left it defined for the GPU, and later tests' interpreted kernels failed calling it ("Cannot
    call @triton.jit'd outside of the scope of a kernel"; e.g. test_readme.py before test_cli.py)."""
    import importlib
    import pkgutil

    import fastgrpo.kernels

    for module in pkgutil.iter_modules(fastgrpo.kernels.__path__):
        importlib.import_module(f"fastgrpo.kernels.{module.name}")


if os.environ.get("TRITON_INTERPRET") == "1":
    _define_every_kernel()

from hypothesis import settings  # noqa: E402

# CI is a 2-core CPU running Triton's interpreter: few, small examples, no deadline.
settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core as memory allows (tests/worker_count.py)."""
    from tests.worker_count import auto_workers

    return auto_workers(config)


def pytest_sessionstart(session):
    """Print the versions this session tests against (a fresh machine gets the newest that pyproject allows), also
    under -q, which hides pytest's report header."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("torch", "triton", "transformers", "peft", "bitsandbytes", "trl", "liger-kernel", "hypothesis"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} absent")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("fastgrpo tested against: " + ", ".join(found))


@pytest.fixture
def no_vllm(monkeypatch):
    """VLLMEngine up to the point where it builds vLLM's engine, on the CPU: building it fails the test (a refusal
    must come first), and the model may stay on the CPU."""
    from fastgrpo.rollout import vllm as vllm_engine

    class NoVLLM:
        def LLM(**kwargs):  # noqa: N802 - vllm.LLM
            pytest.fail("vLLM built its engine")

    monkeypatch.setattr(vllm_engine, "require_vllm", lambda: NoVLLM)
    monkeypatch.setattr(vllm_engine, "check_model", lambda model: None)  # it wants the model on CUDA


@pytest.fixture
def caches(monkeypatch):
    """The rollout engine's StaticKVCache objects, in creation order."""
    from fastgrpo.rollout import decode

    made = []

    class Recorded(decode.StaticKVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(decode, "StaticKVCache", Recorded)
    return made



@pytest.fixture
def compiles(monkeypatch):
    """The engine's torch.compile through a CompileCounter backend; counts every dynamo frame it compiles."""
    import functools

    from torch._dynamo.testing import CompileCounter

    from fastgrpo.rollout import decode

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    counter = CompileCounter()
    monkeypatch.setattr(decode, "_compiled", functools.cache(
        lambda fn, options=(): torch.compile(fn, backend=counter, dynamic=False)))
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()

@pytest.fixture
def delta_calls(monkeypatch):
    """The names of the LoRA ops (lora_add, lora_delta, lora_linear) the patched forwards call, one entry per call."""
    import fastgrpo.patching.forwards as forwards
    from fastgrpo.ops.lora import lora_add, lora_delta, lora_linear_of_checked_values

    calls = []

    def counting(name, op):
        def call(*args, **kwargs):
            calls.append(name)
            return op(*args, **kwargs)

        return call

    ops = {"lora_add": lora_add, "lora_delta": lora_delta, "lora_linear": lora_linear_of_checked_values}
    for name, op in ops.items():
        monkeypatch.setattr(forwards, op.__name__, counting(name, op))
    return calls


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _reward_warnings_start_unsaid(monkeypatch):
    """fastgrpo.rewards.reward_logs says each of its warnings once per process: each test starts with none said. A
    test saw the ones earlier tests left (test_reward_logs' row-by-row test, after the test before it warned of the
    same function, could no longer fail: run alone, it caught its bug)."""
    from fastgrpo.rewards import reward_logs

    monkeypatch.setattr(reward_logs, "_warned", set())


@pytest.fixture(autouse=True)
def _session_torch_threads():
    """A command run in-process on the built-in model takes torch to one thread (default_task.use_one_cpu_thread);
    the next test gets the session's count back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
