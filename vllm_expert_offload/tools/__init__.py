"""Implementations of the `vllm-expert-offload` subcommands, one module each (cli.py only dispatches).

Each module exposes `add_parser(subparsers)`, which registers the subcommand with `handler=run`, and
`run(args) -> int`.
"""
