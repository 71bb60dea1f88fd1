"""A kernel launch's arguments declared once: the torch op's schema, the kernel's keyword arguments and the runtime
signature `bench-kernels --static` compiles are all generated from one `LaunchSpec`.

A fused kernel takes some thirty runtime arguments and a dozen constexprs. Written out by position they were
repeated in five places (the kernel, its launcher, the op's schema string, the call, the static report's signature)
that had to agree by hand. Now:
- the kernel (`@triton.jit`) declares its parameters: Triton binds arguments by name, but takes no structure;
- a `LaunchSpec` lists the op's arguments by name, plain ones (`Arg`) and named structures (frozen dataclasses whose
  fields are `arg(...)`: a projection's `MatrixArgs`, a layer's flags), each with its schema type and the kernel
  arguments it becomes (runtime ones with their Triton types, constexprs by name); and the kernel arguments the
  launcher derives from shapes (`derived`), declared the same way;
- `schema()` is the op's schema; `register(launch)` defines the op and returns a caller that takes exactly the spec's
  arguments by keyword (a missing or unknown one is refused by name) and reaches `launch` with the structures rebuilt;
- the launcher calls `kernel[grid](**spec.kernel_kwargs(args, **derived))`: every kernel argument by name;
- `signature(activation)` is the kernel's runtime signature for tools/static_kernels.py, in the kernel's order.
The spec is checked against the kernel's parameters when it is built: a parameter the spec does not supply, or a
kernel argument the spec makes that the kernel lacks, is refused by name at import.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ..errors import InvalidValueError
from .launch_ops import register_launch

ACTIVATION = "*act"  # Triton type of a pointer to the model's activations: "*fp16", "*bf16" or "*fp32" per variant


@dataclass(frozen=True)
class Arg:
    """One launch argument: its type in the op's schema ("" where the launcher derives it) and the kernel arguments
    it becomes: runtime ones (name -> Triton type) and constexprs, named with "{p}" / "{P}" for the structure field's
    prefix (the structure's name in the spec, as is / upper-cased), made by `expand(value, owner)` (the runtime
    values in order, then the constexprs'; `owner` is the structure, or the op's arguments for a plain one), by
    default the value itself. An argument that becomes no kernel argument is the launcher's alone (a grid size)."""

    schema: str = ""
    kernel: Mapping[str, str] = field(default_factory=dict)
    constexprs: tuple[str, ...] = ()
    expand: Callable[[Any, Any], tuple] | None = None


def arg(schema: str | Arg = "", kernel: Mapping[str, str] | None = None, constexprs: tuple[str, ...] = (),
        expand: Callable[[Any, Any], tuple] | None = None) -> Any:
    """A launch structure's field, declared as an `Arg` (given, or made of the other parameters)."""
    declared = schema if isinstance(schema, Arg) else Arg(schema, kernel or {}, constexprs, expand)
    return field(metadata={"arg": declared})


def pointer(name: str, triton: str, schema: str = "Tensor") -> Arg:
    """A tensor the kernel reads (or writes: schema "Tensor(a!)") through one pointer argument `name`."""
    return Arg(schema, {name: triton})


def strided(name: str, triton: str, strides: tuple[str, ...], schema: str = "Tensor") -> Arg:
    """A tensor the kernel reads (or writes) through pointer `name` and its leading strides (i32 arguments
    `strides`: the first dimension's, then the second's, ...)."""
    return Arg(schema, {name: triton, **{stride: "i32" for stride in strides}},
               expand=lambda t, _: (t, *t.stride()[:len(strides)]))


def integer(name: str) -> Arg:
    """An int argument of the op that the kernel takes as the i32 argument of the same name."""
    return Arg("int", {name: "i32"})


def derived(name: str, triton: str = "i32") -> Arg:
    """A runtime argument the launcher derives (from shapes)."""
    return Arg("", {name: triton})


def constexpr(name: str, schema: str = "") -> Arg:
    """A value the kernel is compiled for: an op argument of type `schema`, or derived by the launcher."""
    return Arg(schema, constexprs=(name,))


class LaunchArgs(SimpleNamespace):
    """One launch's arguments by name (structures rebuilt), as the op hands them to its launcher."""


@dataclass(frozen=True)
class _Leaf:
    """One schema argument (a plain argument, or one field of a structure) and the kernel arguments it becomes."""

    item: str  # the argument's name in the spec
    field: str | None  # the structure's field, None for a plain argument
    arg: Arg
    runtime: tuple[str, ...]  # kernel runtime arguments, prefix filled
    names: tuple[str, ...]  # every kernel argument it makes: the runtime ones, then the constexprs

    @property
    def schema_name(self) -> str:
        return self.item if self.field is None else f"{self.item}_{self.field}"


def _leaves(item: str, declared: Arg | type) -> list[_Leaf]:
    if isinstance(declared, Arg):
        parts = [(None, declared)]
    else:
        parts = [(f.name, f.metadata["arg"]) for f in dataclasses.fields(declared)]
    leaves = []
    for name, a in parts:
        prefix = dict(p=item, P=item.upper())
        runtime = tuple(k.format(**prefix) for k in a.kernel)
        leaves.append(_Leaf(item, name, a, runtime, runtime + tuple(c.format(**prefix) for c in a.constexprs)))
    return leaves


def kernel_parameters(fn: Any) -> dict[str, bool]:
    """A @triton.jit function's parameters in order -> whether each is a constexpr (as Triton decides: the annotation
    names constexpr), compiled or under Triton's interpreter alike."""
    return {p.name: "constexpr" in str(p.annotation) for p in inspect.signature(fn.fn).parameters.values()}


class LaunchSpec:
    """The op `vllm_expert_offload::<op>` launching `kernel`: its arguments (`args`, in schema order) and the kernel
    arguments its launcher derives from shapes (`derived`), each a plain `Arg` or a structure of `arg` fields."""

    def __init__(self, op: str, kernel: Any, args: Mapping[str, Arg | type],
                 derived: Mapping[str, Arg | type] | None = None) -> None:
        self.op = op
        self.kernel = kernel
        self.args = dict(args)
        self.derived = dict(derived or {})
        self._leaves = [leaf for item, declared in self.args.items() for leaf in _leaves(item, declared)]
        self._derived = [leaf for item, declared in self.derived.items() for leaf in _leaves(item, declared)]
        self._check()

    def _check(self) -> None:
        """Refuses, by name, a schema-less argument of the op, a derived one with a schema, a kernel argument made
        twice, and any difference between the kernel arguments made and the kernel's parameters."""
        for leaf in self._leaves:
            if not leaf.arg.schema:
                raise InvalidValueError(f"{self.op}: argument {leaf.schema_name!r} has no schema type")
        for leaf in self._derived:
            if leaf.arg.schema:
                raise InvalidValueError(f"{self.op}: derived {leaf.schema_name!r} has a schema type; derived "
                                        "arguments are not the op's")
        made = [name for leaf in self._leaves + self._derived for name in leaf.names]
        twice = sorted({name for name in made if made.count(name) > 1})
        params = kernel_parameters(self.kernel)
        missing = [name for name in params if name not in made]
        unknown = [name for name in made if name not in params]
        runtime = {name for leaf in self._leaves + self._derived for name in leaf.runtime}
        wrong_kind = [name for name, is_constexpr in params.items()
                      if name in made and is_constexpr == (name in runtime)]
        if twice or missing or unknown or wrong_kind:
            raise InvalidValueError(
                f"{self.op}: the spec and {self.kernel.__name__} disagree: made twice {twice}, parameters not made "
                f"{missing}, made but no parameter {unknown}, runtime/constexpr mismatched {wrong_kind}")

    def schema(self) -> str:
        """The op's schema argument list: each plain argument, and each structure's fields as `<name>_<field>`."""
        return ", ".join(f"{leaf.arg.schema} {leaf.schema_name}" for leaf in self._leaves)

    def signature(self, activation: str = "*fp16") -> dict[str, str]:
        """The kernel's runtime arguments in its parameter order -> Triton type, `ACTIVATION` as `activation`: what
        tools/static_kernels.py compiles."""
        types = {name: triton for leaf in self._leaves + self._derived
                 for name, triton in zip(leaf.runtime, leaf.arg.kernel.values())}
        return {name: activation if types[name] == ACTIVATION else types[name]
                for name, is_constexpr in kernel_parameters(self.kernel).items() if not is_constexpr}

    def kernel_kwargs(self, args: LaunchArgs, **derived: Any) -> dict[str, Any]:
        """Every kernel argument by name, from the op's arguments and what the launcher derived."""
        _same_names(f"{self.op} (derived)", self.derived, derived)
        out: dict[str, Any] = {}
        for leaves, owner in ((self._leaves, args), (self._derived, LaunchArgs(**derived))):
            for leaf in leaves:
                value = getattr(owner, leaf.item)
                scope = owner if leaf.field is None else value
                if leaf.field is not None:
                    value = getattr(value, leaf.field)
                if leaf.arg.expand is not None:
                    made = leaf.arg.expand(value, scope)
                else:
                    made = (value,) if leaf.names else ()  # no kernel argument: the launcher's alone (a grid size)
                out.update(zip(leaf.names, made, strict=True))
        return out

    def register(self, launch: Callable[[LaunchArgs], None]) -> Callable[..., None]:
        """Defines the op (kernels/launch_ops.py) running `launch(LaunchArgs)`; returns the caller, which takes the
        spec's arguments by keyword, structures as instances."""

        def flat_launch(*flat: Any) -> None:
            launch(self._unflatten(flat))

        op = register_launch(self.op, self.schema(), flat_launch)

        def call(**values: Any) -> None:
            op(*self._flatten(values))

        call.__name__ = self.op
        return call

    def _flatten(self, values: Mapping[str, Any]) -> list[Any]:
        _same_names(self.op, self.args, values)
        for item, declared in self.args.items():
            if not isinstance(declared, Arg) and not isinstance(values[item], declared):
                raise InvalidValueError(f"{self.op}: argument {item!r} must be a {declared.__name__}, got "
                                        f"{type(values[item]).__name__}")
        return [values[leaf.item] if leaf.field is None else getattr(values[leaf.item], leaf.field)
                for leaf in self._leaves]

    def _unflatten(self, flat: tuple[Any, ...]) -> LaunchArgs:
        values: dict[str, Any] = {}
        at = 0
        for item, declared in self.args.items():
            if isinstance(declared, Arg):
                values[item] = flat[at]
                at += 1
            else:
                width = len(dataclasses.fields(declared))
                values[item] = declared(*flat[at : at + width])
                at += width
        return LaunchArgs(**values)


def _same_names(what: str, declared: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """Refuses, by name, arguments `declared` that were not given and arguments given that are not declared."""
    missing = [name for name in declared if name not in given]
    unknown = [name for name in given if name not in declared]
    if missing or unknown:
        raise InvalidValueError(f"{what}: missing arguments {missing}, unknown arguments {unknown}")
