"""Tests of the steering op: pure-torch path, the registered op, tracing, and the Triton kernel.

The Triton kernel runs here under ``TRITON_INTERPRET=1`` in a subprocess (the variable must be set before
Triton is imported, and this process may have imported it already); the ``gpu`` test runs it for real.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import hotwire_core.ops as ops
from hotwire_core.ops import steer_torch

REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Rounding once to the residual dtype costs half an ulp; fp32 accumulation adds a little on top.
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-4},
    torch.float16: {"rtol": 1e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 8e-3, "atol": 2e-2},
}
INTERPRETER_UNAVAILABLE = 3  # exit status of the interpreter subprocess when Triton cannot interpret at all


class OpArgs(NamedTuple):
    """Arguments of ``hotwire.steer_`` in schema order."""

    residual: torch.Tensor
    hidden: torch.Tensor | None
    token_cfg: torch.Tensor
    layer_on: torch.Tensor
    cfg_slot: torch.Tensor
    cfg_scale: torch.Tensor
    cfg_rel: torch.Tensor
    bank: torch.Tensor
    inv_norm: torch.Tensor
    layer: int

    def to(self, device: str) -> OpArgs:
        return OpArgs(*(x.to(device) if isinstance(x, torch.Tensor) else x for x in self))


def make_case(seed: int, dtype: torch.dtype, *, with_hidden: bool = True, **dims: int) -> OpArgs:
    """Random tables with every corner the op must honour; ``dims`` pins sizes (see ``sizes``) or ``layer``.

    Config row 0 and the token_cfg tail past T hold garbage: the contract says neither is read. Config 1 is
    scale-only (the kernel skips its norm pass); the rest mix scale-only and norm-relative entries, and slot 0
    (the zero row) appears among them. At least one token is unsteered and one steered.
    """
    g = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (), generator=g))

    sizes = {"n_tokens": randint(2, 40), "hidden_size": randint(1, 300), "k": randint(1, 9)}
    sizes |= {"n_cfg": randint(2, 6), "n_layers": randint(1, 5), "n_slots": randint(2, 12)}
    sizes |= dims
    t, h, k, c, n_layers, s = (sizes[n] for n in ("n_tokens", "hidden_size", "k", "n_cfg", "n_layers", "n_slots"))
    layer = sizes.get("layer", randint(0, n_layers))
    residual = torch.randn(t, h, generator=g).to(dtype)
    hidden = torch.randn(t, h, generator=g).to(dtype) if with_hidden else None
    bank = torch.randn(s, h, generator=g)
    bank[0] = 0
    bank = bank.to(dtype)
    norms = bank.float().norm(dim=1)
    inv_norm = torch.where(norms > 0, 1 / norms, torch.zeros_like(norms))
    cfg_slot = torch.randint(0, s, (c, n_layers, k), generator=g, dtype=torch.int32)
    cfg_scale = torch.randn(c, n_layers, k, generator=g)
    cfg_rel = torch.randn(c, n_layers, k, generator=g) * (torch.rand(c, n_layers, k, generator=g) < 0.5)
    cfg_rel[1] = 0
    token_cfg = torch.randint(0, c, (t + 5,), generator=g, dtype=torch.int32)
    token_cfg[0], token_cfg[1] = 0, randint(1, c)
    token_cfg[t:] = c - 1
    layer_on = torch.randint(0, 2, (n_layers,), generator=g, dtype=torch.int32)
    layer_on[layer] = randint(1, 3)  # any non-zero flag switches the layer on
    return OpArgs(residual, hidden, token_cfg, layer_on, cfg_slot, cfg_scale, cfg_rel, bank, inv_norm, layer)


def reference_steer(a: OpArgs) -> torch.Tensor:
    """The documented semantics, in float64, one token and one stacking entry at a time."""
    out = a.residual.double().clone()
    for t in range(a.residual.shape[0]):
        c = int(a.token_cfg[t])
        if c == 0 or a.layer_on[a.layer] == 0:
            continue
        base = a.residual[t].double()
        if a.hidden is not None:
            base = base + a.hidden[t].double()
        norm = math.sqrt(float((base * base).sum()))
        for k in range(a.cfg_slot.shape[2]):
            s = int(a.cfg_slot[c, a.layer, k])
            scale, rel = float(a.cfg_scale[c, a.layer, k]), float(a.cfg_rel[c, a.layer, k])
            coef = scale + rel * norm * float(a.inv_norm[s])
            out[t] += coef * a.bank[s].double()
    return out


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


def assert_matches_reference(out: torch.Tensor, a: OpArgs) -> None:
    """``out`` is the steered ``a.residual``: close to the reference, and unsteered rows untouched bit for bit."""
    assert out.dtype == a.residual.dtype and out.shape == a.residual.shape
    a, out = a.to("cpu"), out.cpu()
    idle = idle_rows(a)
    torch.testing.assert_close(out[~idle].double(), reference_steer(a)[~idle], **TOL[a.residual.dtype])
    assert same_bits(out[idle], a.residual[idle])


def idle_rows(a: OpArgs) -> torch.Tensor:
    """The rows the op must leave alone: unsteered tokens, or every token at a switched-off layer."""
    return (a.token_cfg[: a.residual.shape[0]] == 0) | (a.layer_on[a.layer] == 0)


def with_poisoned_idle_rows(a: OpArgs) -> OpArgs:
    """NaN and -0.0 in unsteered rows: any arithmetic on them (even adding 0) would show in the bits."""
    residual = a.residual.clone()
    idle = idle_rows(a)
    residual[idle] = -0.0
    residual[idle, 0] = float("nan")
    return a._replace(residual=residual)


def check_triton_against_reference(device: str, pdl: bool = False) -> None:
    """Run the Triton launcher on ``device`` across dtypes, chunk counts and hidden=None; raise on mismatch.
    ``pdl``: launch as a programmatic dependent launch (CUDA, compute capability 9.0+).

    Shared by the interpreter subprocess (CPU tensors) and the gpu test.
    """
    from hotwire_core import triton_steer

    cases = [(seed, dtype, {}) for seed, dtype in zip(range(6), DTYPES * 2)]
    cases += [(10, torch.bfloat16, {"n_tokens": 3, "hidden_size": triton_steer.MAX_BLOCK_H + 5})]  # 2 chunks
    for seed, dtype, sizes in cases:
        for with_hidden in (True, False):
            a = with_poisoned_idle_rows(make_case(seed, dtype, with_hidden=with_hidden, **sizes)).to(device)
            out = a.residual.clone()
            triton_steer.steer_triton_(*a._replace(residual=out), pdl=pdl)
            assert_matches_reference(out, a)
            torch.testing.assert_close(out, steer_torch(*a), equal_nan=True, **TOL[dtype])
    # A steered token at a layer its config leaves alone (all slots 0) is not written: its bits survive.
    a = make_case(40, torch.bfloat16, n_tokens=6, k=3)
    cfg_slot = a.cfg_slot.clone()
    cfg_slot[1, a.layer] = 0
    token_cfg = a.token_cfg.clone()
    token_cfg[:6] = torch.tensor([1, 0, 1, 2 % a.cfg_slot.shape[0], 1, 0], dtype=torch.int32)
    residual = a.residual.clone()
    residual[token_cfg[:6] == 1] = -0.0
    a = a._replace(residual=residual, cfg_slot=cfg_slot, token_cfg=token_cfg).to(device)
    out = a.residual.clone()
    triton_steer.steer_triton_(*a._replace(residual=out), pdl=pdl)
    untouched = token_cfg[:6] == 1
    assert same_bits(out.cpu()[untouched], residual[untouched]), "a row with no entry at this layer was written"
    assert_matches_reference(out, a)
    # A switched-off layer: no row is written, though the tokens' configs have entries there.
    a = with_poisoned_idle_rows(make_case(41, torch.bfloat16, n_tokens=5))
    layer_on = a.layer_on.clone()
    layer_on[a.layer] = 0
    a = a._replace(layer_on=layer_on)
    assert bool((a.cfg_slot[a.token_cfg[:5], a.layer] != 0).any()), "the case has no entry to skip"
    a = with_poisoned_idle_rows(a).to(device)
    out = a.residual.clone()
    triton_steer.steer_triton_(*a._replace(residual=out), pdl=pdl)
    assert same_bits(out.cpu(), a.residual.cpu()), "a row at a switched-off layer was written"
    # Many chunks at a small H, masked tail included.
    default_block = triton_steer.MAX_BLOCK_H
    triton_steer.MAX_BLOCK_H = 32
    try:
        a = make_case(20, torch.float32, hidden_size=100).to(device)
        out = a.residual.clone()
        triton_steer.steer_triton_(*a._replace(residual=out), pdl=pdl)
        assert_matches_reference(out, a)
    finally:
        triton_steer.MAX_BLOCK_H = default_block


# --- steer_torch -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_hidden", [True, False], ids=["hidden", "no_hidden"])
@pytest.mark.parametrize("seed", range(4))
def test_steer_torch_matches_reference(seed: int, with_hidden: bool, dtype: torch.dtype) -> None:
    a = make_case(seed, dtype, with_hidden=with_hidden)
    before = a.residual.clone()
    out = steer_torch(*a)
    assert_matches_reference(out, a)
    assert same_bits(a.residual, before), "steer_torch must not mutate its input"
    assert not torch.equal(out, a.residual), "the case steered nothing: the comparison would prove little"


def test_steer_torch_leaves_idle_rows_bit_identical() -> None:
    a = with_poisoned_idle_rows(make_case(7, torch.bfloat16))
    out = steer_torch(*a)
    idle = idle_rows(a)
    assert same_bits(out[idle], a.residual[idle])
    assert torch.isfinite(out[~idle]).all()


def test_switched_off_layer_is_left_alone() -> None:
    """``layer_on[layer] == 0``: no token is steered at that layer, whatever its config holds there."""
    a = make_case(8, torch.float32, n_tokens=12)
    assert not same_bits(steer_torch(*a), a.residual), "the case steered nothing: the comparison would prove little"
    layer_on = a.layer_on.clone()
    layer_on[a.layer] = 0
    off = with_poisoned_idle_rows(a._replace(layer_on=layer_on))
    assert same_bits(steer_torch(*off), off.residual)
    residual = off.residual.clone()
    torch.ops.hotwire.steer_(*off._replace(residual=residual))
    assert same_bits(residual, off.residual)
    torch.ops.hotwire.steer_(*off._replace(residual=residual, layer_on=a.layer_on))  # switched on: it steers
    assert not same_bits(residual, off.residual)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_steer_torch_without_norm_term(dtype: torch.dtype) -> None:
    """``use_norm=False`` is the reference with every norm-relative coefficient zeroed."""
    a = make_case(11, dtype)
    no_rel = a._replace(cfg_rel=torch.zeros_like(a.cfg_rel))
    out = steer_torch(*a, use_norm=False)
    assert_matches_reference(out, no_rel)
    assert same_bits(out, steer_torch(*no_rel))


def test_norm_relative_entry_by_hand() -> None:
    """residual+hidden = [3, 4] (norm 5); bank row [0, 2] (inv_norm 0.5); rel 1 adds 5 * 0.5 * [0, 2] = [0, 5]."""
    residual = torch.tensor([[1.0, 1.0], [7.0, 7.0]])
    hidden = torch.tensor([[2.0, 3.0], [0.0, 0.0]])
    bank = torch.tensor([[0.0, 0.0], [0.0, 2.0]])
    inv_norm = torch.tensor([0.0, 0.5])
    cfg_slot = torch.tensor([[[0]], [[1]]], dtype=torch.int32)  # [C=2, L=1, K=1]
    cfg_scale = torch.zeros(2, 1, 1)
    cfg_rel = torch.tensor([[[0.0]], [[1.0]]])
    token_cfg = torch.tensor([1, 0, 1], dtype=torch.int32)
    on = torch.ones(1, dtype=torch.int32)
    out = steer_torch(residual, hidden, token_cfg, on, cfg_slot, cfg_scale, cfg_rel, bank, inv_norm, 0)
    assert out.tolist() == [[1.0, 6.0], [7.0, 7.0]]
    # Without hidden the norm is |[1, 1]| = sqrt(2).
    out = steer_torch(residual, None, token_cfg, on, cfg_slot, cfg_scale, cfg_rel, bank, inv_norm, 0)
    torch.testing.assert_close(out, torch.tensor([[1.0, 1.0 + math.sqrt(2)], [7.0, 7.0]]))


def test_stacked_entries_add_up() -> None:
    """Two entries on one slot equal one entry with the summed scale; a slot-0 entry adds nothing."""
    a = make_case(3, torch.float32, k=4)
    layer, slot = a.layer, a.cfg_slot[1, a.layer, 0].clamp(min=1)
    cfg_slot, cfg_scale, cfg_rel = a.cfg_slot.clone(), a.cfg_scale.clone(), a.cfg_rel.clone()
    cfg_slot[1, layer] = 0
    cfg_slot[1, layer, :2] = slot
    cfg_scale[1, layer] = 5.0  # the slot-0 entries carry a scale too, on the zero row
    cfg_scale[1, layer, :2] = torch.tensor([1.5, 2.5])
    cfg_rel[1, layer] = 0
    token_cfg = torch.ones_like(a.token_cfg)
    a = a._replace(token_cfg=token_cfg, layer_on=torch.ones_like(a.layer_on), cfg_slot=cfg_slot, cfg_scale=cfg_scale, cfg_rel=cfg_rel)
    stacked = steer_torch(*a)
    expected = a.residual + 4.0 * a.bank[slot]
    torch.testing.assert_close(stacked, expected)
    assert not torch.allclose(stacked, a.residual + 1.5 * a.bank[slot])


# --- registered op -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_hidden", [True, False], ids=["hidden", "no_hidden"])
def test_op_on_cpu_mutates_in_place(with_hidden: bool, dtype: torch.dtype) -> None:
    a = with_poisoned_idle_rows(make_case(11, dtype, with_hidden=with_hidden))
    expected = steer_torch(*a)
    residual = a.residual.clone()
    ptr = residual.data_ptr()
    assert torch.ops.hotwire.steer_(*a._replace(residual=residual)) is None
    assert residual.data_ptr() == ptr
    assert same_bits(residual, expected)
    assert_matches_reference(residual, a)


def test_a_gate_without_steer_makes_the_op_a_no_op() -> None:
    """A gate without STEER (no steered request this step) launches nothing, even where token_cfg says steer."""
    a = make_case(13, torch.float32)
    residual = a.residual.clone()
    try:
        for kinds in (ops.IDLE, ops.READ | ops.CAPTURE):
            ops.GATE.kinds = kinds
            torch.ops.hotwire.steer_(*a._replace(residual=residual))
            assert same_bits(residual, a.residual)
    finally:
        ops.GATE.kinds = ops.ALL
    torch.ops.hotwire.steer_(*a._replace(residual=residual))
    assert same_bits(residual, steer_torch(*a))
    assert not same_bits(residual, a.residual)


def test_register_ops_is_idempotent() -> None:
    ops.register_ops()
    ops.register_ops()
    a = make_case(12, torch.float32)
    residual = a.residual.clone()
    torch.ops.hotwire.steer_(*a._replace(residual=residual))
    assert same_bits(residual, steer_torch(*a))


def test_import_is_cheap_and_reload_safe() -> None:
    """Importing (and re-importing) the op must not touch CUDA or Triton: CPU-only workers import it too."""
    script = (
        "import importlib, sys, torch\n"
        "import hotwire_core.ops as ops\n"
        "importlib.reload(ops)\n"
        "ops.register_ops()\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert 'hotwire_core.triton_steer' not in sys.modules\n"
        "r, one = torch.zeros(1, 2), torch.ones(2, 1, 1)\n"
        "torch.ops.hotwire.steer_(r, None, torch.ones(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),\n"
        "    one.int(), one, 0 * one,\n"
        "    torch.tensor([[0.0, 0.0], [1.0, 2.0]]), torch.ones(2), 0)\n"
        "assert r.tolist() == [[1.0, 2.0]], r\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_op_compiles_fullgraph_on_cpu() -> None:
    """Dynamo traces the op through its fake impl, and Inductor fuses steer_torch; both match eager."""
    a = make_case(13, torch.float32)

    def step(x: torch.Tensor, y: torch.Tensor, args: OpArgs) -> tuple[torch.Tensor, torch.Tensor]:
        x = x * 2
        torch.ops.hotwire.steer_(x, *args[1:])
        y = steer_torch(y * 2, *args[1:]) + 1
        return x + 1, y

    compiled = torch.compile(step, fullgraph=True)
    got_op, got_torch = compiled(a.residual.clone(), a.residual.clone(), a)
    want_op, want_torch = step(a.residual.clone(), a.residual.clone(), a)
    torch.testing.assert_close(got_op, want_op)
    torch.testing.assert_close(got_torch, want_torch)
    assert not torch.allclose(got_op, a.residual * 2 + 1), "the compiled op steered nothing"


# --- Triton kernel -----------------------------------------------------------------------------------------


_INTERPRETER_SCRIPT = f"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
try:
    import torch, triton, triton.language as tl

    @triton.jit
    def _probe(x):
        tl.store(x, tl.load(x) + 1)

    probe = torch.zeros(1)
    _probe[(1,)](probe)
    assert probe.item() == 1.0, "interpreter ran but computed nothing"
except Exception as exc:
    print(f"triton interpreter unusable: {{exc!r}}")
    sys.exit({INTERPRETER_UNAVAILABLE})
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_ops
test_ops.check_triton_against_reference("cpu")
"""


def test_triton_kernel_in_interpreter() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    if proc.returncode == INTERPRETER_UNAVAILABLE:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr


if torch.cuda.is_available():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents

    @triton.jit
    def _slow_copy_kernel(src_ptr, dst_ptr, scratch_ptr, spins, row_len, BLOCK: tl.constexpr):
        """Copy one row, late: let programmatic dependents start at once, then spin before writing, so that a
        dependent that reads the rows without waiting for this kernel reads what was there before."""
        gdc_launch_dependents()
        x = tl.load(scratch_ptr)
        for _ in range(spins):
            x = x * 3 + 1
        tl.store(scratch_ptr + 1 + tl.program_id(0), x)  # keeps the loop
        offs = tl.arange(0, BLOCK)
        row = tl.program_id(0).to(tl.int64) * row_len
        values = tl.load(src_ptr + row + offs, mask=offs < row_len)
        tl.store(dst_ptr + row + offs, values, mask=offs < row_len)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_op_and_graph_replay(pdl: bool, monkeypatch) -> None:
    if pdl and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    monkeypatch.setattr(ops, "PDL", pdl)
    check_triton_against_reference("cuda", pdl=pdl)
    dims = {"n_tokens": 64, "hidden_size": 5120, "k": 4, "n_cfg": 6, "n_layers": 3, "n_slots": 9, "layer": 2}
    for with_hidden in (True, False):
        a = with_poisoned_idle_rows(make_case(30, torch.bfloat16, with_hidden=with_hidden, **dims)).to("cuda")
        residual = a.residual.clone()
        torch.ops.hotwire.steer_(*a._replace(residual=residual))  # also compiles the kernel before capture
        assert_matches_reference(residual, a)
        captured = residual.clone()

        # As in a model: a kernel writes the rows right before the op and another reads them right after. The
        # writer lets its dependents start at once and writes milliseconds later, so an op that did not wait for
        # it would read the zeroed rows; the reader is launched plainly and must see the op's writes.
        source, after = a.residual.clone(), torch.empty_like(residual)
        scratch = torch.zeros(1 + dims["n_tokens"], dtype=torch.int32, device="cuda")
        block = triton.next_power_of_2(dims["hidden_size"])

        def write_rows(spins: int) -> None:
            _slow_copy_kernel[(dims["n_tokens"],)](source, residual, scratch, spins, dims["hidden_size"], BLOCK=block)

        write_rows(1)  # compiles the writer before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            write_rows(1 << 21)
            torch.ops.hotwire.steer_(*a._replace(residual=residual))
            torch.mul(residual, 1, out=after)
        # New contents in the same buffers: the replay must read them, not what was there at capture.
        b = make_case(31, torch.bfloat16, with_hidden=with_hidden, **dims).to("cuda")
        for dst, src in zip(a[1:-1], b[1:-1]):
            if dst is not None:
                dst.copy_(src)
        source.copy_(b.residual)
        residual.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(residual, b)
        assert same_bits(after.cpu(), residual.cpu()), "the kernel after the op read rows the op had not written"
        assert not torch.equal(residual, b.residual)
        assert not torch.equal(residual, captured), "replay gave the captured-time result"
        # The layer switched off after capture (in the buffer the graph reads): every row is left alone.
        a.layer_on[a.layer] = 0
        residual.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits(residual.cpu(), b.residual.cpu()), "a replay at a switched-off layer wrote a row"
