"""Wrap one vLLM function in one module, idempotently, refusing a signature it was not written for; add a method
to a vLLM class, never replacing one; or shadow a vLLM method on one object for a while. The mechanism only: every
use is declared in vllm_hooks.py.

vLLM internals move between releases; a wrapper silently applied to a changed function is worse than none, so each
hook names the parameters it was read against (on the vLLM series in `versions.VERIFIED_VLLM`) and fails loudly
when the function is missing or takes others. On a newer vLLM that check is what stands between a changed internal
and a silent misfit; an older vLLM is refused outright (versions.py says why).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
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


def _check_params(target: str, function: Callable, expected: tuple[str, ...]) -> None:
    params = tuple(inspect.signature(function).parameters)
    if params != expected:
        raise HookError(
            f"{target} takes {params}; the hook was written for {expected} (vLLM "
            f"{', '.join(VERIFIED_VLLM)}). This vLLM changed it: the plugin refuses to patch it blindly"
        )


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
    wrap: Callable[..., Callable]  # wrap(original, *context) -> the wrapper
    loaded_only: bool = False
    kind = "wrap"

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

    def install(self, *context: object) -> bool:
        """Wrap the target by `wrap(original, *context)`; False when its module is not loaded (`loaded_only`) or it
        is wrapped already."""
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
        _check_params(self.target, function, self.params)
        wrapper = self.wrap(function, *context)
        setattr(wrapper, SENTINEL, True)
        setattr(owner, attr, kind(wrapper) if kind is not None else wrapper)
        return True


@dataclass(frozen=True)
class ClassHook:
    """The same wrap of method `name` on classes chosen at run time (`where` says which): `for_class` gives the
    signature-checked Hook on one class's own module and qualified name."""

    name: str
    params: tuple[str, ...]
    wrap: Callable[..., Callable]
    where: str
    kind = "wrap per class"

    @property
    def target(self) -> str:
        return f"<{self.where}>.{self.name}"

    def for_class(self, cls: type) -> Hook:
        return Hook(cls.__module__, f"{cls.__qualname__}.{self.name}", self.params, self.wrap)


@dataclass(frozen=True)
class Addition:
    """Add `value` to vLLM's class `module.cls` as attribute `name`; refused where vLLM has that name already."""

    module: str
    cls: str
    name: str
    value: Callable
    kind = "add"

    @property
    def target(self) -> str:
        return f"{self.module}.{self.cls}.{self.name}"

    def install(self) -> bool:
        """Add the attribute; False when it is ours already."""
        if not self.module.startswith("vllm."):
            raise HookError(f"{self.target}: additions go to vLLM's own classes only")
        owner = getattr(importlib.import_module(self.module), self.cls, None)
        if owner is None:
            raise HookError(f"{self.module}.{self.cls} does not exist in this vLLM")
        existing = getattr(owner, self.name, None)
        if existing is self.value:
            return False
        if existing is not None:
            raise HookError(f"{self.target}: vLLM already has this attribute; the plugin never replaces it")
        setattr(owner, self.name, self.value)
        return True


@dataclass(frozen=True)
class InstancePatch:
    """Shadow method `name` ("Class.method") of vLLM's class in `module` on one object (an instance, or a class
    such as the running platform's) while a `with` block runs: the object's own attribute becomes `wrap(the
    object's current attribute, *context)`, and what the object had of its own before comes back when the block
    ends. The class's method is checked against `params` as a Hook's is, even when the object is a stand-in."""

    module: str
    name: str
    params: tuple[str, ...]
    wrap: Callable[..., object]
    kind = "wrap on one object, for a while"

    @property
    def target(self) -> str:
        return f"{self.module}.{self.name}"

    @contextlib.contextmanager
    def applied(self, obj: object, *context: object) -> Iterator[None]:
        if not self.module.startswith("vllm."):
            raise HookError(f"{self.target}: instance patches go to vLLM's own classes only")
        cls_name, _, attr = self.name.rpartition(".")
        owner = getattr(importlib.import_module(self.module), cls_name, None)
        try:
            raw = inspect.getattr_static(owner, attr)
        except AttributeError:
            raise HookError(f"{self.target} does not exist in this vLLM") from None
        _check_params(self.target, inspect.unwrap(getattr(raw, "__func__", raw)), self.params)
        own = getattr(obj, "__dict__", {})
        had_own, before = attr in own, own.get(attr)
        setattr(obj, attr, self.wrap(getattr(obj, attr), *context))
        try:
            yield
        finally:
            if had_own:
                setattr(obj, attr, before)
            else:
                delattr(obj, attr)
