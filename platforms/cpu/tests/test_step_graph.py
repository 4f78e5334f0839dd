"""Step graphs: kernel calls recorded during a real run and replayed from C++ on new inputs,
against the same calls made eagerly; and the guard that refuses forwards it cannot replay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.worker.step_graphs import StepGraphUnsupported
from tokenmill_platform_cpu.kernels import kernels_available, load_kernels
from tokenmill_platform_cpu.layer_ops import CpuLayerOps
from tokenmill_platform_cpu.step_graph import active_kernels, capture_step_graph

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")


def _pool(max_rows: int = 8):
    return load_kernels().GraphPool(max_rows)


@pytest.fixture(scope="module")
def ops() -> CpuLayerOps:
    return CpuLayerOps(load_kernels(), packed_budget=1 << 40)


class _TinyBlock:
    """Embedding, a projection, a norm, a gated MLP with bias and a residual add: the
    kinds of call a decoder layer makes, on weights of a few hundred columns."""

    def __init__(self, ops: CpuLayerOps, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(0)
        self.ops = ops
        self.table = torch.randn(100, 64, generator=g).to(dtype)
        self.proj = torch.randn(96, 64, generator=g).to(dtype)
        self.norm = torch.rand(96, generator=g).to(dtype)
        self.gate_up = torch.randn(2 * 128, 96, generator=g).to(dtype)
        self.bias = torch.randn(2 * 128, generator=g).to(dtype)
        self.down = torch.randn(96, 128, generator=g).to(dtype)
        self.prepared = {name: ops.prepare_linear_weight(getattr(self, name)) for name in ("proj", "gate_up", "down")}

    def linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.ops.linear(x, getattr(self, name), bias, self.prepared[name])

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        residual = self.linear(F.embedding(ids, self.table), "proj")
        h = self.ops.rms_norm(residual, self.norm, 1e-6)
        h = self.linear(self.ops.silu_and_mul(self.linear(h, "gate_up", self.bias)), "down")
        return self.ops.add_rms_norm(h, residual, self.norm, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_replay_reruns_every_kernel_on_new_inputs(ops, dtype, rows):
    """Rows 1-2 take the small-matmul kernel, 5 the packed panels (float32) or the small
    kernel (bfloat16); each replay must equal the same block run eagerly on the new ids."""
    block = _TinyBlock(ops, dtype)
    ids = torch.arange(rows)
    graph, (out,) = capture_step_graph(load_kernels(), lambda: (block(ids),), _pool(), rows)
    torch.testing.assert_close(out, block(ids))
    for seed in range(3):
        ids.copy_(torch.randint(0, 100, (rows,), generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.testing.assert_close(out, block(ids))
    assert len(graph) == 7  # embedding, four matmuls, norm, SiLU, add + norm


def test_profile_replays_and_times_each_kernel(ops):
    block = _TinyBlock(ops, torch.float32)
    ids = torch.arange(2)
    graph, (out,) = capture_step_graph(load_kernels(), lambda: (block(ids),), _pool(), 2)
    ids.copy_(torch.tensor([7, 3]))
    times = graph.profile()
    torch.testing.assert_close(out, block(ids))  # a profiled replay is a replay
    assert [name for name, _ in times] == ["embedding", "small_linear", "rms_norm", "small_linear", "silu_and_mul",
                                           "small_linear", "add_rms_norm_"]
    assert all(seconds > 0 for _, seconds in times)


def test_the_forward_must_return_a_tuple_of_tensors(ops):
    x, norm = torch.randn(2, 64), torch.ones(64)
    with pytest.raises(StepGraphUnsupported, match="returned Tensor, not a tuple of tensors"):
        capture_step_graph(load_kernels(), lambda: ops.rms_norm(x, norm, 1e-6), _pool(), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_linear_is_lowered_to_a_graph_op(ops, dtype):
    """Matmuls the kernels do not take (bfloat16 past six rows, float32 on unpacked weights)
    go to torch's linear, which the capture records as a graph op of its own."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=g).to(dtype)
    weight, bias = torch.randn(48, 64, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return ops.linear(x, weight, bias, None), F.linear(x[:8], weight, bias=bias)  # bias by keyword too

    graph, (out, half) = capture_step_graph(load_kernels(), run, _pool(16), 16)
    x.copy_(torch.randn(16, 64, generator=g).to(dtype))
    graph.replay()
    torch.testing.assert_close(out, F.linear(x, weight, bias))
    torch.testing.assert_close(half, F.linear(x[:8], weight, bias))
    assert [name for name, _ in graph.profile()] == ["linear", "linear"]


def test_contiguous_copies_are_replayed(ops):
    """The attention backend makes the query contiguous when it is a strided view of the
    fused qkv output (decode batches of two or more): the copy must be redone each replay."""
    x = torch.randn(2, 2 * 64)
    weight = torch.randn(32, 64)

    def run() -> tuple[torch.Tensor]:
        return (ops.linear(x[:, :64].contiguous(), weight, None, None),)

    graph, (out,) = capture_step_graph(load_kernels(), run, _pool(), 2)
    x.copy_(torch.randn(2, 2 * 64))
    graph.replay()
    torch.testing.assert_close(out, x[:, :64] @ weight.T)


WEIGHT = torch.ones(4, 64)
INDEX = torch.tensor([1, 0])
MASK = torch.ones(2, dtype=torch.bool)


@pytest.mark.parametrize(("name", "run", "reason"), [
    ("torch compute", lambda x: x * 2, "mul computes outside the kernels"),
    ("in-place write", lambda x: x.add_(1), "add_ writes a tensor outside the kernels"),
    ("in-place operator", lambda x: x.__iadd__(1), "add_ writes a tensor outside the kernels"),
    ("in-place bitwise operator", lambda x: MASK.__ior__(MASK), "__ior__ writes a tensor outside the kernels"),
    ("item assignment", lambda x: x.__setitem__(0, 1.0), "__setitem__ writes"),
    ("out= argument", lambda x: torch.mul(x, 2, out=x), "mul writes"),
    ("value read into Python", lambda x: x[0, 0].item(), "item reads a value outside the kernels"),
    ("torch matmul", lambda x: torch.matmul(x, WEIGHT.T), "matmul computes outside the kernels"),
    ("a new tensor of values", lambda x: torch.ones(2), "ones computes outside the kernels"),
    ("advanced indexing", lambda x: x[INDEX], "__getitem__ computes"),
])
def test_capture_refuses_what_it_cannot_replay(ops, name, run, reason):
    x, norm = torch.randn(2, 64), torch.ones(64)
    with pytest.raises(StepGraphUnsupported, match=reason.replace(".", r"\.")):
        capture_step_graph(load_kernels(), lambda: (run(ops.rms_norm(x, norm, 1e-6)),), _pool(), 2)


def test_views_and_allocations_are_allowed(ops):
    x, norm = torch.randn(2, 4, 16), torch.ones(64)

    def run() -> tuple[torch.Tensor]:
        flat = x.view(2, 64).reshape(2, 64)
        assert flat.shape[0] == flat.size(0) == len(flat) and flat.dim() == 2 and flat.is_contiguous()
        empty = torch.empty(3)  # allocated, never read: harmless
        del empty
        return (ops.rms_norm(flat, norm, 1e-6)[:, :32].transpose(0, 1),)

    graph, (out,) = capture_step_graph(load_kernels(), run, _pool(), 2)
    x.copy_(torch.randn(2, 4, 16))
    graph.replay()
    torch.testing.assert_close(out, ops.rms_norm(x.view(2, 64), norm, 1e-6)[:, :32].T)


def test_a_kernel_without_a_graph_form_is_refused():
    kernels = load_kernels()
    logits, temperature, uniform = torch.randn(1, 8), torch.ones(1), torch.rand(1)
    with pytest.raises(StepGraphUnsupported, match="temperature_sample"):
        capture_step_graph(kernels, lambda: (active_kernels(kernels).temperature_sample(logits, temperature, uniform),),
                           _pool(), 1)


def test_graphs_of_one_pool_share_buffers_and_replay_in_turn(ops):
    """The graphs of one runner (one per batch size) write into the same pooled buffers:
    each replay must still give its own batch's result, whichever graph ran before."""
    pool = _pool(4)
    block = _TinyBlock(ops, torch.float32)
    ids = {rows: torch.arange(rows) for rows in (1, 4, 2)}
    graphs = {rows: capture_step_graph(load_kernels(), lambda rows=rows: (block(ids[rows]),), pool, rows)
              for rows in ids}
    assert len({out.untyped_storage().data_ptr() for _, (out,) in graphs.values()}) == 1
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        for rows, (graph, (out,)) in graphs.items():
            ids[rows].copy_(torch.randint(0, 100, (rows,), generator=generator))
            graph.replay()
            torch.testing.assert_close(out, block(ids[rows]))


# A namespace of test ops defined from Python (the convention holds for any namespace): `scaled` has
# an out overload, `doubled` has none, `lying` has one that writes something else than the op.
_TEST_OPS = torch.library.Library("tokenmill_step_graph_test", "DEF")
_TEST_OPS.define("scaled(Tensor x, float factor=2.0) -> Tensor")
_TEST_OPS.define("scaled.out(Tensor x, float factor=2.0, *, Tensor(a!) out) -> Tensor(a!)")
_TEST_OPS.define("doubled(Tensor x) -> Tensor")
_TEST_OPS.define("lying(Tensor x) -> Tensor")
_TEST_OPS.define("lying.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)")
_TEST_OPS.impl("scaled", lambda x, factor=2.0: x * factor, "CPU")
_TEST_OPS.impl("scaled.out", lambda x, factor=2.0, *, out: torch.mul(x, factor, out=out), "CPU")
_TEST_OPS.impl("doubled", lambda x: x * 2, "CPU")
_TEST_OPS.impl("lying", lambda x: x + 1, "CPU")
_TEST_OPS.impl("lying.out", lambda x, *, out: out.copy_(x), "CPU")


def test_a_registered_op_with_an_out_overload_is_replayed_through_it(ops):
    """A call of torch.ops.<ns>.<name> (here aten's mm and addmm, C++ ops with out overloads,
    keyword and scalar arguments included, and a Python-defined op of another namespace) is
    recorded as a call of its out overload into a pooled buffer: each replay reruns it on the
    new inputs."""
    g = torch.Generator().manual_seed(4)
    x, norm = torch.randn(3, 64, generator=g), torch.rand(64, generator=g)
    weight, bias = torch.randn(64, 24, generator=g), torch.randn(24, generator=g)

    def eager() -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.ops.aten.mm(ops.rms_norm(x, norm, 1e-6), weight)
        scaled = torch.ops.tokenmill_step_graph_test.scaled(h, factor=0.5)
        return scaled, torch.ops.aten.addmm.default(bias, h, weight[:24], beta=0.25, alpha=3)

    graph, (scaled, added) = capture_step_graph(load_kernels(), eager, _pool(), 3)
    assert [name for name, _ in graph.profile()] == ["rms_norm", "aten::mm.out", "tokenmill_step_graph_test::scaled.out",
                                                     "aten::addmm.out"]
    for seed in range(2):
        x.copy_(torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        expected = eager()
        assert torch.equal(scaled, expected[0]) and torch.equal(added, expected[1])


@pytest.mark.parametrize(("op", "reason"), [
    (lambda x: torch.ops.tokenmill_step_graph_test.doubled(x),
     "torch op tokenmill_step_graph_test::doubled computes outside the kernels and has no out overload"),
    (lambda x: torch.ops.aten.cosine_similarity(x, x), "torch op aten::cosine_similarity computes"),
    (lambda x: torch.ops.tokenmill_step_graph_test.lying(x),
     "torch op tokenmill_step_graph_test::lying.out wrote other values than tokenmill_step_graph_test::lying computed"),
])
def test_a_registered_op_without_a_faithful_out_overload_is_refused_by_name(ops, op, reason):
    x, norm = torch.randn(2, 64), torch.ones(64)
    with pytest.raises(StepGraphUnsupported, match=reason):
        capture_step_graph(load_kernels(), lambda: (op(ops.rms_norm(x, norm, 1e-6)),), _pool(), 2)
