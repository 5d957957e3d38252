"""The `llamatron` commands: one module each, each with `register(subparsers)` adding its sub-parser and setting
`func`, the function `cli.main` calls with the parsed arguments (its return value is the exit status)."""

from . import bench, eval, generate, hf, megatron, plan, preprocess, train

# In the order `llamatron --help` lists them.
COMMANDS = (train, preprocess, generate, eval, hf, megatron, bench, plan)

__all__ = ["COMMANDS"]
