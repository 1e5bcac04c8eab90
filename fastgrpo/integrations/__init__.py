"""Adapters that put fastgrpo's kernels under other libraries' trainers. Each lives in its own module and imports its
library only there: `from fastgrpo.integrations.trl import FastGRPOTrainer` (needs `pip install "fastgrpo[trl]"`)."""
