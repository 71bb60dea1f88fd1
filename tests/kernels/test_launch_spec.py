"""A launch's arguments declared once (kernels/launch_spec.py): the op's schema and the static report's signature are
both generated from the spec, a field added to a structure reaches both, the spec is checked against the kernel's
parameters, calls are by keyword (missing or unknown names refused by name), and the kernel receives every argument
under its own name (a kernel under Triton's interpreter stores what it was given)."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensorMode

from vllm_expert_offload.errors import InvalidValueError
from vllm_expert_offload.kernels import triton_dequantize, triton_exl3, triton_linear, triton_moe, triton_prefill
from vllm_expert_offload.kernels.launch_spec import (LaunchArgs, LaunchSpec, arg, constexpr, derived, integer,
                                                     pointer)
from vllm_expert_offload.kernels.matrix_table import MatrixTable
from vllm_expert_offload.kernels.triton_moe_steps import INPUT_ROWS, MatrixArgs, writes_through


@triton.jit
def _echo(x_ptr, stride_xm, hidden, size_n, gate_trellis, gate_twice_k, gate_codebook, gate_fill, out_ptr,
          TWICE_K_GATE: tl.constexpr, CODEBOOK_GATE: tl.constexpr, FILL: tl.constexpr):
    """Stores what it was handed, each in its own place: the runtime scalars, the constexprs, a word of each table."""
    tl.store(out_ptr + 0, stride_xm)
    tl.store(out_ptr + 1, hidden)
    tl.store(out_ptr + 2, size_n)
    tl.store(out_ptr + 3, TWICE_K_GATE)
    tl.store(out_ptr + 4, CODEBOOK_GATE)
    tl.store(out_ptr + 5, FILL)
    tl.store(out_ptr + 6, tl.load(gate_trellis))
    tl.store(out_ptr + 7, tl.load(gate_twice_k))
    tl.store(out_ptr + 8, tl.load(gate_codebook))
    tl.store(out_ptr + 9, tl.load(gate_fill))
    tl.store(out_ptr + 10, tl.load(x_ptr + stride_xm).to(tl.int64))


@triton.jit
def _echo_with_extra(x_ptr, stride_xm, hidden, size_n, gate_trellis, gate_twice_k, gate_codebook, gate_fill,
                     gate_extra, out_ptr, TWICE_K_GATE: tl.constexpr, CODEBOOK_GATE: tl.constexpr, FILL: tl.constexpr):
    tl.store(out_ptr, gate_extra)


@dataclasses.dataclass(slots=True)
class _WithExtra(MatrixArgs):
    """MatrixArgs with one more field, as a change adding a per-matrix argument would make it."""

    extra: int = arg("int", {"{p}_extra": "i32"})


def _spec(kernel, matrices: type = MatrixArgs, op: str = "") -> LaunchSpec:
    return LaunchSpec(op or f"probe_{uuid.uuid4().hex}", kernel,
                      {"x": INPUT_ROWS, "gate": matrices, "out": pointer("out_ptr", "*i64", "Tensor(a!)")},
                      derived={"size_n": derived("size_n"), "fill": constexpr("FILL")})


def test_a_field_added_to_a_structure_reaches_the_schema_and_the_signature() -> None:
    plain, extra = _spec(_echo), _spec(_echo_with_extra, _WithExtra)
    assert plain.schema() == ("Tensor x, Tensor gate_trellis, Tensor gate_twice_k, Tensor gate_codebook, "
                              "Tensor? gate_fill, int gate_uniform_twice_k, int gate_uniform_codebook, Tensor(a!) out")
    assert extra.schema() == plain.schema().replace(", Tensor(a!) out", ", int gate_extra, Tensor(a!) out")
    # in the kernel's order (the PTX parameters'), not the spec's: size_n, derived, comes fourth
    assert list(plain.signature("*bf16").items()) == [
        ("x_ptr", "*bf16"), ("stride_xm", "i32"), ("hidden", "i32"), ("size_n", "i32"), ("gate_trellis", "*i64"),
        ("gate_twice_k", "*i32"), ("gate_codebook", "*i32"), ("gate_fill", "*i64"), ("out_ptr", "*i64")]
    with_extra = list(extra.signature("*bf16").items())
    assert with_extra == list(plain.signature("*bf16").items())[:8] + [("gate_extra", "i32"), ("out_ptr", "*i64")]


def test_the_spec_and_the_kernel_must_name_the_same_arguments() -> None:
    with pytest.raises(InvalidValueError, match=r"made but no parameter \['gate_extra'\]"):
        _spec(_echo, _WithExtra)  # a field the kernel does not take
    with pytest.raises(InvalidValueError, match=r"parameters not made \['gate_extra'\]"):
        _spec(_echo_with_extra)  # a kernel parameter nothing supplies
    with pytest.raises(InvalidValueError, match=r"runtime/constexpr mismatched \['FILL'\]"):
        LaunchSpec("probe", _echo, {"x": INPUT_ROWS, "gate": MatrixArgs, "out": pointer("out_ptr", "*i64")},
                   derived={"size_n": derived("size_n"), "fill": derived("FILL")})
    with pytest.raises(InvalidValueError, match=r"argument 'n' has no schema type"):
        LaunchSpec("probe", _echo, {"x": INPUT_ROWS, "gate": MatrixArgs, "out": pointer("out_ptr", "*i64"),
                                    "n": derived("size_n")}, derived={"fill": constexpr("FILL")})
    with pytest.raises(InvalidValueError, match=r"derived 'size_n' has a schema type"):
        LaunchSpec("probe", _echo, {"x": INPUT_ROWS, "gate": MatrixArgs, "out": pointer("out_ptr", "*i64")},
                   derived={"size_n": integer("size_n"), "fill": constexpr("FILL")})
    with pytest.raises(InvalidValueError, match=r"made twice \['size_n'\]"):
        LaunchSpec("probe", _echo, {"x": INPUT_ROWS, "gate": MatrixArgs, "out": pointer("out_ptr", "*i64"),
                                    "n": pointer("size_n", "i32", "int")},
                   derived={"size_n": derived("size_n"), "fill": constexpr("FILL")})


def test_the_backends_ops_are_registered_with_the_generated_schemas() -> None:
    specs = (triton_moe.GATE_UP, triton_moe.DOWN, triton_moe.SUM, triton_prefill.GATE_UP, triton_prefill.DOWN,
             triton_dequantize.SPEC, triton_linear.LINEAR, triton_linear.FINISH)
    for spec in specs:
        schema = getattr(torch.ops.vllm_expert_offload, spec.op).default._schema
        assert str(schema) == f"vllm_expert_offload::{spec.op}({spec.schema()}) -> ()"
    assert ("Tensor gate_trellis, Tensor gate_twice_k, Tensor gate_codebook, Tensor? gate_fill, "
            "int gate_uniform_twice_k" in triton_moe.GATE_UP.schema())


def _table(trellis: int) -> MatrixTable:
    return MatrixTable(torch.tensor([trellis]), torch.tensor([6], dtype=torch.int32),
                       torch.tensor([2], dtype=torch.int32), 2, 128, 256, 6)


def _echoed(fill: torch.Tensor | None) -> list[int]:
    calls = []

    def launch(args: LaunchArgs) -> None:
        calls.append(args)
        _echo[(1,)](**spec.kernel_kwargs(args, size_n=96, fill=writes_through(args.gate)))

    spec = _spec(_echo)
    call = spec.register(launch)
    x = torch.arange(2 * 48, dtype=torch.float32).view(2, 48)
    out = torch.zeros(11, dtype=torch.int64)
    call(x=x, gate=MatrixArgs.of(_table(41), fill), out=out)
    (args,) = calls
    assert isinstance(args.gate, MatrixArgs) and args.gate.uniform_codebook == 2 and args.gate.fill is fill
    return out.tolist()


def test_the_kernel_gets_each_argument_by_its_name() -> None:
    """Strides, widths and constexprs land where the kernel names them; without a fill table the kernel is compiled
    without the copy and handed the trellis table, unread."""
    assert _echoed(torch.tensor([77])) == [48, 48, 96, 6, 2, 1, 41, 6, 2, 77, 48]
    assert _echoed(None) == [48, 48, 96, 6, 2, 0, 41, 6, 2, 41, 48]


def test_calls_take_exactly_the_specs_arguments_by_name() -> None:
    y, ids, out = torch.zeros(1, 2, 128), torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, 128)
    with pytest.raises(InvalidValueError, match=r"missing arguments \['out'\], unknown arguments \[\]"):
        triton_moe._sum(y=y, ids=ids)
    with pytest.raises(InvalidValueError, match=r"missing arguments \[\], unknown arguments \['bogus'\]"):
        triton_moe._sum(y=y, ids=ids, out=out, bogus=1)
    with pytest.raises(TypeError):
        triton_moe._sum(y, ids, out)  # by position: refused
    with pytest.raises(InvalidValueError, match=r"argument 'gate' must be a MatrixArgs, got MatrixTable"):
        _spec(_echo).register(lambda args: None)(x=torch.zeros(1, 48), gate=_table(1), out=torch.zeros(1))
    with pytest.raises(InvalidValueError, match=r"\(derived\): missing arguments \['fill'\], unknown arguments "
                                                r"\['size'\]"):
        _spec(_echo).kernel_kwargs(LaunchArgs(), size_n=1, size=1)


def test_a_launch_runs_nothing_on_meta_or_fake_tensors() -> None:
    calls = []
    call = _spec(_echo).register(calls.append)
    meta = torch.empty(1, 48, device="meta")
    call(x=meta, gate=MatrixArgs.of(dataclasses.replace(_table(1), trellis=torch.empty(1, device="meta"))),
         out=torch.empty(11, device="meta"))
    with FakeTensorMode():
        call(x=torch.empty(1, 48), gate=MatrixArgs.of(_table(1)), out=torch.empty(11))
    assert calls == []


def test_fill_tables_come_for_every_projection_or_none() -> None:
    filled, bare = MatrixArgs.of(_table(1), torch.zeros(1, dtype=torch.int64)), MatrixArgs.of(_table(1))
    assert writes_through(filled, filled) and not writes_through(bare, bare)
    with pytest.raises(InvalidValueError, match="every projection of a launch or for none"):
        writes_through(filled, bare)


def test_the_matmul_launcher_reads_the_table_field_for_field() -> None:
    """TRITON_MATMUL's op takes the contract's MatrixTable; the kernel's arguments come from it field by field, so a
    field MatrixTable gains must be one the kernel is told about."""
    assert [f.name for f in dataclasses.fields(triton_exl3.TableArgs)] == \
        [f.name for f in dataclasses.fields(MatrixTable)]
    assert triton_exl3.TableArgs.of(_table(5)).uniform_twice_k == 6


def test_an_expand_making_too_few_kernel_arguments_is_refused() -> None:
    """The generated kernel_kwargs unpacks each expand's values into its names: a count that differs raises."""
    short = dataclasses.replace(INPUT_ROWS, expand=lambda x, _: (x, x.stride(0)))
    spec = LaunchSpec("probe", _echo, {"x": short, "gate": MatrixArgs, "out": pointer("out_ptr", "*i64")},
                      derived={"size_n": derived("size_n"), "fill": constexpr("FILL")})
    args = LaunchArgs(x=torch.zeros(1, 48), gate=MatrixArgs.of(_table(1)), out=torch.zeros(1))
    with pytest.raises(ValueError, match="not enough values to unpack"):
        spec.kernel_kwargs(args, size_n=1, fill=False)
    assert "k_x_ptr, k_stride_xm, k_hidden, = expand_0(args.x, args)" in spec.kernel_kwargs_source


def test_declared_unit_strides_and_alignment_are_refused_by_name_when_broken() -> None:
    """What a spec declares true at every launch (the static report compiles it so) is checked at every launch: a
    16-byte-misaligned pointer and a declared-aligned int that is not a multiple of 16 are refused, each by its
    kernel argument's name; a launch keeping them passes, and undeclared ints take any value."""
    spec = LaunchSpec(f"probe_{uuid.uuid4().hex}", _echo,
                      {"x": INPUT_ROWS, "gate": MatrixArgs, "out": pointer("out_ptr", "*i64", "Tensor(a!)")},
                      derived={"size_n": derived("size_n", aligned=True), "fill": constexpr("FILL")})
    out = torch.zeros(16, dtype=torch.int64)

    def kwargs(x: torch.Tensor, size_n: int = 256) -> dict:
        return spec.kernel_kwargs(LaunchArgs(x=x, gate=MatrixArgs.of(_table(1)), out=out), size_n=size_n, fill=False)

    assert kwargs(torch.zeros(2, 100))["stride_xm"] == 100
    with pytest.raises(InvalidValueError, match="'x_ptr' is at address .*16-byte-aligned"):
        kwargs(torch.zeros(2, 132)[:, 1:129])  # 4 bytes in
    with pytest.raises(InvalidValueError, match="'size_n' is 264, .*multiple of 16"):
        kwargs(torch.zeros(2, 128), size_n=264)
    with pytest.raises(InvalidValueError, match="'out_ptr' is at address"):
        spec.kernel_kwargs(LaunchArgs(x=torch.zeros(2, 128), gate=MatrixArgs.of(_table(1)), out=out[1:]),
                           size_n=256, fill=False)


def test_the_fused_launch_refuses_a_non_unit_routing_stride_and_the_layer_hands_dense_rows() -> None:
    """Routing's last strides are declared 1 (compiled as constants): a launch handed a column view is refused by
    the argument's name; `dense_rows` copies such a view (and a 16-byte-misaligned one), keeps a dense one."""
    from vllm_expert_offload.kernels.triton_moe_steps import dense_rows

    route = torch.zeros(4, 16)[:, ::2]  # stride (16, 2)
    ids = torch.zeros(4, 8, dtype=torch.int64)
    routing = triton_moe.Routing(route, ids, ids, ids)
    with pytest.raises(InvalidValueError, match="'stride_r1' is 2, .*the constant 1"):
        triton_moe.GATE_UP._make(LaunchArgs(x=torch.zeros(1, 128), routing=routing), LaunchArgs())
    assert dense_rows(route).stride() == (8, 1)
    misaligned = torch.zeros(5, 6)[1:]  # starts 24 bytes in: one DP rank's rows of top-6 router weights
    assert misaligned.data_ptr() % 16 and dense_rows(misaligned).data_ptr() % 16 == 0
    assert torch.equal(dense_rows(misaligned), misaligned)
    assert dense_rows(ids) is ids
