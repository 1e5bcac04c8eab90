"""`python -m fastgrpo <command> ...` and the `fastgrpo` console script (launchers that start modules use the
former: torchrun -m, a job script without the script on PATH)."""
import os
import sys
import traceback


def main() -> int:
    """The CLI (fastgrpo.train.cli). A Ctrl-C or SIGTERM while it imports torch and transformers (seconds, before a
    command takes the signals) ends as one during a command does: one line, exit 130 / 143 (--debug: a Ctrl-C's
    traceback); one that a library swallowed (torch's import of numpy) stops the command too (starting_signals)."""
    from fastgrpo.train.interrupts import (
        Terminated,
        interrupted_while_starting,
        starting_signals,
        terminated_while_starting,
    )

    with starting_signals():
        try:
            from fastgrpo.train.cli import main as run

            return run()
        except KeyboardInterrupt as stop:
            terminated = isinstance(stop, Terminated)
            if "--debug" in sys.argv:
                if not terminated:
                    raise
                traceback.print_exc()  # Terminated raised on would end the process with exit 1
        except Exception as err:  # transformers' lazy imports re-raise a KeyboardInterrupt as a ModuleNotFoundError
            if "--debug" in sys.argv or not (_caused_by_interrupt(err) or interrupted_while_starting()):
                raise
            terminated = terminated_while_starting()
    # torchrun passes a signal to every process: the first one says it. torchrun's RANK read here, not through
    # ranks.is_main_process, which imports torch.distributed: torch may be the import the signal cut
    if os.environ.get("RANK", "0") == "0":
        print(f"fastgrpo: {'terminated' if terminated else 'interrupted'}", file=sys.stderr, flush=True)
    return Terminated.exit_code if terminated else 130


def _caused_by_interrupt(err: BaseException | None) -> bool:
    while err is not None:
        if isinstance(err, KeyboardInterrupt):
            return True
        err = err.__cause__ or err.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())
