"""`python -m fastgrpo <command> ...`: the `fastgrpo` console script, for launchers that start modules (torchrun
-m, a job script without the script on PATH)."""
import sys

from fastgrpo.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
