"""Wrap one vLLM function in one module, idempotently, refusing a signature it was not written for.

vLLM internals move between releases; a wrapper silently applied to a changed function is worse than none, so each
hook names the parameters it was read against (on the vLLM series in `versions.VERIFIED_VLLM`) and fails loudly
when the function is missing or takes others. On a newer vLLM that check is what stands between a changed internal
and a silent misfit; an older vLLM is refused outright (versions.py says why).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ExpertOffloadError
from .versions import VERIFIED_VLLM, refusal

SENTINEL = "__vllm_expert_offload_hook__"


class HookError(ExpertOffloadError, RuntimeError):
    """A hook's target is not what it was checked against: an older vLLM, a missing or changed function."""


def require_checked_version(hook: str, vllm_version: str | None = None) -> None:
    """Refuse to install `hook` on a vLLM it may not patch (versions.refusal: an older, unverified series)."""
    if vllm_version is None:
        import vllm

        vllm_version = vllm.__version__
    reason = refusal(vllm_version)
    if reason is not None:
        raise HookError(f"{hook}: {reason}")


@dataclass(frozen=True)
class Hook:
    """Replace `module.name` by `wrap(original)`; a dotted `name` ("Class.method") wraps a class attribute.

    `params` are the original's parameter names as read on vLLM `VERIFIED_VLLM` (for a classmethod or staticmethod,
    those of the function it wraps, `cls` included); the wrapper keeps the descriptor kind. `loaded_only` hooks
    rebind a name that another module imported from the defining module: they act only if that module is already
    imported (a later import picks up the wrapper from the defining module itself), which keeps heavy runner
    modules out of processes that never run a model.
    """

    module: str
    name: str
    params: tuple[str, ...]
    wrap: Callable[[Callable], Callable]
    loaded_only: bool = False

    @property
    def target(self) -> str:
        return f"{self.module}.{self.name}"

    def check_version(self, vllm_version: str) -> None:
        require_checked_version(self.target, vllm_version)

    def _owner(self) -> object | None:
        if not self.module.startswith("vllm."):
            raise HookError(f"{self.target}: hooks patch vLLM's own modules only")
        if self.loaded_only:
            module = sys.modules.get(self.module)
            if module is None:
                return None
        else:
            module = importlib.import_module(self.module)
        owner = module
        for part in filter(None, self.name.rpartition(".")[0].split(".")):
            owner = getattr(owner, part, None)
            if owner is None:
                raise HookError(f"{self.target} does not exist in this vLLM")
        return owner

    def install(self) -> bool:
        """Wrap the target; False when its module is not loaded (`loaded_only`) or it is wrapped already."""
        owner = self._owner()
        if owner is None:
            return False
        attr = self.name.rpartition(".")[2]
        try:
            raw = inspect.getattr_static(owner, attr)
        except AttributeError:
            raise HookError(f"{self.target} does not exist in this vLLM") from None
        kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
        function = raw.__func__ if kind is not None else raw
        if getattr(function, SENTINEL, False):
            return False
        params = tuple(inspect.signature(function).parameters)
        if params != self.params:
            raise HookError(
                f"{self.target} takes {params}; the hook was written for {self.params} (vLLM "
                f"{', '.join(VERIFIED_VLLM)}). This vLLM changed it: the plugin refuses to patch it blindly"
            )
        wrapper = self.wrap(function)
        setattr(wrapper, SENTINEL, True)
        setattr(owner, attr, kind(wrapper) if kind is not None else wrapper)
        return True
