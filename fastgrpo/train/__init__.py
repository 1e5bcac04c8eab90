"""The training loop: config, trainer, command line, checkpoints, the built-in default task."""
