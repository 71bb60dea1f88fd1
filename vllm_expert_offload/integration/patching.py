"""Wrap one vLLM function in one module, idempotently, refusing versions and signatures it was not checked on.

vLLM internals move between releases; a wrapper silently applied to a changed function is worse than none,
so each hook names the vLLM series and the parameters it was read against and fails loudly otherwise.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ExpertOffloadError
from .versions import vllm_series

SENTINEL = "__vllm_expert_offload_hook__"


class HookError(ExpertOffloadError, RuntimeError):
    """A hook's target is not what it was checked against: unknown vLLM version, missing or changed function."""


def require_checked_version(hook: str, checked_on: tuple[str, ...]) -> None:
    """Refuse to install `hook` on a vLLM series it was not read against."""
    from .versions import check_vllm_version

    series = check_vllm_version()
    if series not in checked_on:
        raise HookError(f"{hook} was checked on vLLM {', '.join(checked_on)} only; this is vLLM {series}")


@dataclass(frozen=True)
class Hook:
    """Replace `module.name` by `wrap(original)`; a dotted `name` ("Class.method") wraps a class attribute.

    `loaded_only` hooks rebind a name that another module imported from the defining module: they act only if
    that module is already imported (a later import picks up the wrapper from the defining module itself),
    which keeps heavy runner modules out of processes that never run a model.
    """

    module: str
    name: str
    params: tuple[str, ...]
    checked_on: tuple[str, ...]
    wrap: Callable[[Callable], Callable]
    loaded_only: bool = False

    @property
    def target(self) -> str:
        return f"{self.module}.{self.name}"

    def check_version(self, vllm_version: str) -> None:
        if vllm_series(vllm_version) not in self.checked_on:
            raise HookError(
                f"{self.target}: this hook was checked on vLLM {', '.join(self.checked_on)} only; "
                f"this is vLLM {vllm_version}"
            )

    def install(self) -> bool:
        """Wrap the target; False when its module is not loaded (`loaded_only`) or it is wrapped already."""
        if not self.module.startswith("vllm."):
            raise HookError(f"{self.target}: hooks patch vLLM's own modules only")
        if self.loaded_only:
            module = sys.modules.get(self.module)
            if module is None:
                return False
        else:
            module = importlib.import_module(self.module)
        owner_path, _, attr = self.name.rpartition(".")
        owner = module
        for part in filter(None, owner_path.split(".")):
            owner = getattr(owner, part, None)
            if owner is None:
                raise HookError(f"{self.target} does not exist in this vLLM")
        current = getattr(owner, attr, None)
        if current is None:
            raise HookError(f"{self.target} does not exist in this vLLM")
        if getattr(current, SENTINEL, False):
            return False
        params = tuple(inspect.signature(current).parameters)
        if params != self.params:
            raise HookError(f"{self.target} takes {params}; the hook was written for {self.params}")
        wrapper = self.wrap(current)
        setattr(wrapper, SENTINEL, True)
        setattr(owner, attr, wrapper)
        return True
