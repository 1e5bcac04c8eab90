"""A command's stderr carries no other library's log lines its user cannot act on: bitsandbytes, imported through
peft (a LoRA run, or transformers' TrainerState built for reward functions), logs on a CPU with AVX512-BF16 and no
`kernels` package that its optional CPU 4-bit kernel is missing."""
import logging

from fastgrpo.train.errors import run_command

HINT = ("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip install "
        "kernels` and the kernels >= 0.11.1")


def test_bitsandbytes_cpu_kernel_hint_is_dropped_during_a_command_only(caplog):
    library = logging.getLogger("bitsandbytes.backends.cpu.ops")

    def body():
        library.warning(HINT, "No module named 'kernels'")
        library.warning("another bitsandbytes warning")
        return 0

    assert run_command("fastgrpo train", body) == 0
    logged = [record.getMessage() for record in caplog.records]
    assert logged == ["another bitsandbytes warning"], logged
    library.warning(HINT, "outside a command")  # the filter goes with the command
    assert "outside a command" in caplog.records[-1].getMessage()
