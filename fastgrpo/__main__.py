"""`python -m fastgrpo <command> ...` and the `fastgrpo` console script (launchers that start modules use the
former: torchrun -m, a job script without the script on PATH)."""
import sys


def main() -> int:
    """The CLI (fastgrpo.train.cli). A Ctrl-C while it imports torch and transformers (seconds, before a command
    takes the signals) ends as one during a command does: one line, exit 130 (--debug: the traceback); one that a
    library swallowed (torch's import of numpy) stops the command too (starting_signals)."""
    from fastgrpo.train.interrupts import interrupted_while_starting, starting_signals

    with starting_signals():
        try:
            from fastgrpo.train.cli import main as run

            return run()
        except KeyboardInterrupt:
            if "--debug" in sys.argv:
                raise
        except Exception as err:  # transformers' lazy imports re-raise a KeyboardInterrupt as a ModuleNotFoundError
            if "--debug" in sys.argv or not (_caused_by_interrupt(err) or interrupted_while_starting()):
                raise
    print("fastgrpo: interrupted", file=sys.stderr, flush=True)
    return 130


def _caused_by_interrupt(err: BaseException | None) -> bool:
    while err is not None:
        if isinstance(err, KeyboardInterrupt):
            return True
        err = err.__cause__ or err.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())
