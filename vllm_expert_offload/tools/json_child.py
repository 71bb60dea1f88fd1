"""Run one of the tools' modules in a child Python and read the JSON it prints: for work that needs Triton in the
other mode than this process (its interpreter is chosen once, at import: ahead-of-time compiles need it off, the
launch census on the CPU needs it on)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import ToolRunError


def run_json(module: str, args: list[str], triton_interpret: bool) -> Any:
    """`python -m module *args` with TRITON_INTERPRET set or removed; its stdout's last line, parsed. Its stderr
    (progress) passes through; a failure raises with the child's exit status."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if triton_interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-m", module, *args], env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise ToolRunError(f"python -m {module} {' '.join(args)} failed with exit status {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def resolve(target: str) -> Callable:
    """"package.module:name" or "path/to/file.py:name" -> the object."""
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)
