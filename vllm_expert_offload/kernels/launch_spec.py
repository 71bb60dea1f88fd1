"""A kernel launch's arguments declared once: the torch op's schema, the kernel's keyword arguments and the runtime
signature `bench-kernels --static` compiles are all generated from one `LaunchSpec`.

A fused kernel takes some thirty runtime arguments and a dozen constexprs. Written out by position they were
repeated in five places (the kernel, its launcher, the op's schema string, the call, the static report's signature)
that had to agree by hand. Now:
- the kernel (`@triton.jit`) declares its parameters: Triton binds arguments by name, but takes no structure;
- a `LaunchSpec` lists the op's arguments by name, plain ones (`Arg`) and named structures (dataclasses whose fields
  are `arg(...)`: a projection's `MatrixArgs`, a layer's flags), each with its schema type and the kernel
  arguments it becomes (runtime ones with their Triton types, constexprs by name); and the kernel arguments the
  launcher derives from shapes (`derived`), declared the same way;
- `schema()` is the op's schema; `register(launch)` defines the op and returns a caller that takes exactly the spec's
  arguments by keyword (a missing or unknown one is refused by name) and reaches `launch` with the structures rebuilt;
- the launcher calls `kernel[grid](**spec.kernel_kwargs(args, **derived))`: every kernel argument by name;
- `signature(activation)` is the kernel's runtime signature for tools/static_kernels.py, in the kernel's order, and
  `specialised(activation, values)` the whole key Triton's JIT compiles a launch under (below).
What is true of an argument at every launch is declared with it, so that the static report compiles the variant a GPU
runs: Triton's JIT compiles an int argument equal to 1 as the constant 1 and gives a 16-divisible int or a 16-byte-
aligned pointer `tt.divisibility` 16 (wider loads and stores). A unit stride is declared `unit`, a pointer (every
tensor the launches pass is 16-byte aligned) or an int that is a multiple of 16 (widths of whole 128-wide pieces)
`aligned`; the launch refuses, by name, a value that breaks its declaration (a GPU would otherwise run a variant the
report never measured, or, had it been compiled for the declaration, read wrong memory).
The spec is checked against the kernel's parameters when it is built: a parameter the spec does not supply, or a
kernel argument the spec makes that the kernel lacks, is refused by name at import.

A launch's host time is part of every forward vLLM runs eagerly (batches above its largest CUDA-graph size), so what
each launch does is cheap: the spec writes its flattening, unflattening and kernel arguments out as straight-line
code once (`kernel_kwargs_source` shows the last), and the structures are slotted dataclasses, built per launch (a
frozen dataclass's __init__ costs four times as much).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple

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
    unit: tuple[str, ...] = ()  # runtime kernel arguments equal to 1 at every launch (the JIT's constant 1)
    aligned: tuple[str, ...] = ()  # runtime kernel arguments 16-byte-aligned (pointers) / multiples of 16 (ints)


def arg(schema: str | Arg = "", kernel: Mapping[str, str] | None = None, constexprs: tuple[str, ...] = (),
        expand: Callable[[Any, Any], tuple] | None = None, aligned: tuple[str, ...] = ()) -> Any:
    """A launch structure's field, declared as an `Arg` (given, or made of the other parameters)."""
    declared = schema if isinstance(schema, Arg) else Arg(schema, kernel or {}, constexprs, expand, (), aligned)
    return field(metadata={"arg": declared})


def pointer(name: str, triton: str, schema: str = "Tensor") -> Arg:
    """A tensor the kernel reads (or writes: schema "Tensor(a!)") through one pointer argument `name`, 16-byte
    aligned (torch's allocations are; a launch refuses a view that is not)."""
    return Arg(schema, {name: triton}, aligned=(name,))


def strided(name: str, triton: str, strides: tuple[str, ...], schema: str = "Tensor", dense: bool = False,
            aligned: bool = False) -> Arg:
    """A tensor the kernel reads (or writes) through pointer `name` and its leading strides (i32 arguments
    `strides`: the first dimension's, then the second's, ...). `dense`: at every launch the last of them is 1 and
    the pointer 16-byte aligned (a tensor the layer made so: an activation's view may be neither); `aligned`: the
    pointer alone is (a tensor the layer allocates, whose last stride is not an argument)."""
    return Arg(schema, {name: triton, **{stride: "i32" for stride in strides}},
               expand=lambda t, _: (t, *t.stride()[:len(strides)]), unit=strides[-1:] if dense else (),
               aligned=(name,) if dense or aligned else ())


def integer(name: str, aligned: bool = False) -> Arg:
    """An int argument of the op that the kernel takes as the i32 argument of the same name; `aligned`: a multiple of
    16 at every launch."""
    return Arg("int", {name: "i32"}, aligned=(name,) if aligned else ())


def derived(name: str, triton: str = "i32", aligned: bool = False) -> Arg:
    """A runtime argument the launcher derives (from shapes); `aligned`: a multiple of 16 at every launch."""
    return Arg("", {name: triton}, aligned=(name,) if aligned else ())


def constexpr(name: str, schema: str = "") -> Arg:
    """A value the kernel is compiled for: an op argument of type `schema`, or derived by the launcher."""
    return Arg(schema, constexprs=(name,))


class Specialised(NamedTuple):
    """One compiled variant's runtime signature (name -> Triton type), constants and 16-aligned arguments."""

    signature: dict[str, str]
    constants: dict[str, int]
    aligned: tuple[str, ...]


def _not_specialised(kernel: Any) -> set[str]:
    """The kernel's `do_not_specialize` parameters (by name), compiled or under Triton's interpreter alike."""
    listed = getattr(kernel, "do_not_specialize", None)
    if listed is None:
        listed = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    names = list(kernel_parameters(kernel))
    return {names[p] if isinstance(p, int) else p for p in listed}


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
    unit: tuple[str, ...]  # of `runtime`, those declared 1 at every launch, prefix filled
    aligned: tuple[str, ...]  # of `runtime`, those declared 16-aligned / multiples of 16, prefix filled

    @property
    def schema_name(self) -> str:
        return self.item if self.field is None else f"{self.item}_{self.field}"

    @property
    def path(self) -> str:
        """Where its value is among the op's arguments: `<item>` or `<item>.<field>`."""
        return self.item if self.field is None else f"{self.item}.{self.field}"


def _declared_checks(op: str, leaf: _Leaf) -> list[str]:
    """The lines refusing, by name, a kernel argument of `leaf` that breaks its declaration (unit, aligned)."""
    types = dict(zip(leaf.runtime, leaf.arg.kernel.values()))
    lines = [f"if k_{n} != 1: refuse({op!r}, {n!r}, k_{n}, 'the constant 1')" for n in leaf.unit]
    for n in leaf.aligned:
        if types[n].startswith("*"):
            lines.append(f"if k_{n}.data_ptr() % 16: refuse({op!r}, {n!r}, f'at address {{k_{n}.data_ptr():#x}}', "
                         "'a 16-byte-aligned address')")
        else:
            lines.append(f"if k_{n} % 16: refuse({op!r}, {n!r}, k_{n}, 'a multiple of 16')")
    return lines


def _compiled(name: str, parameters: str, lines: list[str], env: dict[str, Any]) -> Callable[..., Any]:
    """A function of `parameters` whose body is `lines`, with `env` its globals (a spec's generated code)."""
    source = f"def generated({parameters}):\n" + "".join(f"    {line}\n" for line in lines)
    exec(compile(source, f"<launch spec {name}>", "exec"), env)  # noqa: S102 (source made from the spec's names)
    return env["generated"]


def _leaves(item: str, declared: Arg | type) -> list[_Leaf]:
    if isinstance(declared, Arg):
        parts = [(None, declared)]
    else:
        parts = [(f.name, f.metadata["arg"]) for f in dataclasses.fields(declared)]
    leaves = []
    for name, a in parts:
        prefix = dict(p=item, P=item.upper())
        runtime = tuple(k.format(**prefix) for k in a.kernel)
        leaves.append(_Leaf(item, name, a, runtime, runtime + tuple(c.format(**prefix) for c in a.constexprs),
                            tuple(u.format(**prefix) for u in a.unit), tuple(d.format(**prefix) for d in a.aligned)))
    return leaves


def _refuse(op: str, name: str, value: Any, declared: str) -> None:
    raise InvalidValueError(f"{op}: kernel argument {name!r} is {value}, but the kernel is compiled for {declared} "
                            "(declared in its LaunchSpec)")


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
        # Each launch's host work, written out once for this spec and compiled: what a launcher would spell by hand.
        self._structures = [(item, declared) for item, declared in self.args.items() if not isinstance(declared, Arg)]
        reads = [f"values[{leaf.item!r}]" + ("" if leaf.field is None else f".{leaf.field}") for leaf in self._leaves]
        self._flat = _compiled(f"{op} flatten", "values", [f"return ({''.join(f'{r}, ' for r in reads)})"], {})
        self._make, self.kernel_kwargs_source = self._written_out()
        self._unflatten = self._unflatten_function()

    def _written_out(self) -> tuple[Callable[[LaunchArgs, LaunchArgs], dict[str, Any]], str]:
        """kernel_kwargs's body for this spec, one statement per argument: `k_<name> = args.<item>.<field>`, or the
        kernel arguments an expand makes unpacked from its call (a wrong count raises); then the dict by name."""
        lines, names, env = [], [], {"refuse": _refuse}
        for owner, leaves in (("args", self._leaves), ("derived", self._derived)):
            for leaf in leaves:
                if not leaf.names:
                    continue  # the launcher's alone (a grid size)
                value = f"{owner}.{leaf.path}"
                if leaf.arg.expand is None:
                    lines.append(f"k_{leaf.names[0]} = {value}")
                else:
                    expand = f"expand_{len(env) - 1}"  # env holds `refuse`, then the expands
                    env[expand] = leaf.arg.expand
                    scope = owner if leaf.field is None else f"{owner}.{leaf.item}"
                    lines.append(f"{''.join(f'k_{n}, ' for n in leaf.names)}= {expand}({value}, {scope})")
                names += leaf.names
                lines += _declared_checks(self.op, leaf)
        lines.append(f"return {{{', '.join(f'{n!r}: k_{n}' for n in names)}}}")
        return _compiled(f"{self.op} kernel_kwargs", "args, derived", lines, env), "\n".join(lines)

    def _unflatten_function(self) -> Callable[..., LaunchArgs]:
        """The op's flat arguments back into LaunchArgs, structures rebuilt, written out for this spec."""
        parts, env, at = [], {"LaunchArgs": LaunchArgs}, 0
        for item, declared in self.args.items():
            if isinstance(declared, Arg):
                parts.append(f"{item}=flat[{at}]")
                at += 1
            else:
                env[f"structure_{item}"] = declared
                width = len(dataclasses.fields(declared))
                parts.append(f"{item}=structure_{item}(*flat[{at}:{at + width}])")
                at += width
        return _compiled(f"{self.op} unflatten", "flat", [f"return LaunchArgs({', '.join(parts)})"], env)

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
        """The kernel's runtime arguments in its parameter order -> Triton type, `ACTIVATION` as `activation`, less
        those declared unit (compiled as constants, `constants()`): what tools/static_kernels.py compiles."""
        types = {name: triton for leaf in self._leaves + self._derived
                 for name, triton in zip(leaf.runtime, leaf.arg.kernel.values())}
        unit = self.constants()
        return {name: activation if types[name] == ACTIVATION else types[name]
                for name, is_constexpr in kernel_parameters(self.kernel).items() if not is_constexpr and name not in unit}

    def constants(self) -> dict[str, int]:
        """The runtime arguments declared 1 at every launch -> 1: Triton's JIT compiles them as constants."""
        return {name: 1 for leaf in self._leaves + self._derived for name in leaf.unit}

    def declared_aligned(self) -> set[str]:
        """The runtime arguments declared 16-aligned (pointers) / multiples of 16 (ints) at every launch, which the
        launch checks: the rest of a variant's aligned arguments are so by the launch's values (`specialised`)."""
        return {name for leaf in self._leaves + self._derived for name in leaf.aligned}

    def specialised(self, activation: str, values: Mapping[str, int]) -> Specialised:
        """The key Triton's JIT compiles a launch under, as tools/static_kernels.py compiles it: the runtime
        signature, the constants (declared unit, and ints of `values` equal to 1) and the 16-aligned arguments
        (declared, and ints of `values` that are multiples of 16). `values`: the launch's value of each int argument
        that no declaration classifies and the kernel specialises on (a shape's K steps, a split's parts); a missing
        or unknown one is refused by name."""
        declared = set(self.constants()) | self.declared_aligned()
        signature = self.signature(activation)
        free = [name for name, triton in signature.items() if triton.startswith("i") and name not in declared
                and name not in _not_specialised(self.kernel)]
        if sorted(free) != sorted(values):
            _same_names(f"{self.op} (values of unclassified ints)", dict.fromkeys(free), values)
        constants = self.constants() | {name: 1 for name, value in values.items() if value == 1}
        aligned = [name for name in signature if name not in constants
                   and (name in declared or values.get(name, 1) % 16 == 0)]
        return Specialised({n: t for n, t in signature.items() if n not in constants}, constants, tuple(aligned))

    def kernel_kwargs(self, args: LaunchArgs, **derived: Any) -> dict[str, Any]:
        """Every kernel argument by name, from the op's arguments and what the launcher derived."""
        if derived.keys() != self.derived.keys():
            _same_names(f"{self.op} (derived)", self.derived, derived)
        return self._make(args, LaunchArgs(**derived))

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

    def _flatten(self, values: Mapping[str, Any]) -> tuple[Any, ...]:
        if values.keys() != self.args.keys():
            _same_names(self.op, self.args, values)
        for item, declared in self._structures:
            if not isinstance(values[item], declared):
                raise InvalidValueError(f"{self.op}: argument {item!r} must be a {declared.__name__}, got "
                                        f"{type(values[item]).__name__}")
        return self._flat(values)

def _same_names(what: str, declared: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """Refuses, by name, arguments `declared` that were not given and arguments given that are not declared."""
    missing = [name for name in declared if name not in given]
    unknown = [name for name in given if name not in declared]
    if missing or unknown:
        raise InvalidValueError(f"{what}: missing arguments {missing}, unknown arguments {unknown}")
