"""The steering custom op ``torch.ops.hotwire.steer_`` (see docs/architecture.md, "The op").

Registered straight on a ``torch.library.Library`` fragment, as vLLM's ``direct_register_custom_op`` does, to
skip ``torch.library.custom_op``'s Python dispatch overhead on every decoder layer. The CPU kernel is the
pure-torch ``steer_torch``; the CUDA kernel is Triton (``hotwire_core.triton_steer``), imported on first use
so that importing this module neither needs a working Triton nor initialises CUDA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

OP_NAMESPACE = "hotwire"
OP_NAME = "steer_"
_SCHEMA = (
    f"{OP_NAME}(Tensor(a!) residual, Tensor? hidden, Tensor token_cfg, Tensor layer_on, Tensor cfg_slot, "
    "Tensor cfg_scale, Tensor cfg_rel, Tensor bank, Tensor inv_norm, int layer, Tensor? cfg_gate=None, "
    "Tensor? token_read=None, Tensor? token_pos=None, Tensor? token_hit=None, Tensor? gate_row=None) -> ()"
)
# Gated steering (hotwire_core.gates): gate_row's columns, per readout row; the flags' bits.
GATE_LAYER, GATE_PROBE, GATE_FLAGS, GATE_FIRST, GATE_PROMPT_LEN = range(5)
GATE_BELOW, GATE_LATCH, GATE_COSINE, GATE_PROMPT = 1, 2, 4, 8
NEVER = 2**31 - 1  # GATE_FIRST of a latch that has not fired

IDLE, STEER, READ, CAPTURE = 0, 1, 2, 4  # which of hotwire's ops a forward launches (Gate.kinds): a mask
ALL = STEER | READ | CAPTURE


def graph_variants(read: bool, capture: bool) -> tuple[int, ...]:
    """The masks every CUDA graph is captured for, cheapest first, ``ALL`` last: idle (no hotwire node at all:
    vLLM's own graph) and ``ALL`` always; steering alone where another op is compiled in, so a steered step does
    not launch it at every layer; reading alone and with steering where the read op is compiled in (monitors read
    in every step, steered or not). Capturing for extraction is rare: its steps replay ``ALL``."""
    variants = [IDLE]
    if read or capture:
        variants.append(STEER)
    if read:
        variants.append(READ)
    if read and capture:
        variants.append(STEER | READ)
    return (*variants, ALL)


def kinds_name(kinds: int) -> str:
    """``"idle"``, ``"all"``, or the ops a mask launches joined by ``+`` (``"steer+read"``)."""
    if kinds == ALL:
        return "all"
    names = ((STEER, "steer"), (READ, "read"), (CAPTURE, "capture"))
    return "+".join(name for bit, name in names if kinds & bit) or "idle"


class Gate:
    """Which of hotwire's ops the forward being run (or captured into a CUDA graph) launches: ``kinds``, a mask
    of STEER, READ and CAPTURE; an op whose kind is off is a no-op that launches nothing.

    ``split`` is set once a model is hooked with idle graphs on (``HOTWIRE_IDLE_GRAPHS``), and ``variants``
    (:func:`graph_variants`) to the masks ``vllm_glue`` captures every graph for. The runner then sets ``kinds``
    before every forward to the first variant that covers what the step needs (``covering``), and through
    ``on_change`` the glue puts that variant's graph set in place when it changes (not on every graph replay).
    """

    def __init__(self) -> None:
        self._kinds = ALL
        self.on_change: Callable[[int], None] | None = None
        self.configure(False, read=False, capture=False)

    def configure(self, split: bool, read: bool, capture: bool) -> None:
        self.split = split
        self.variants: tuple[int, ...] = graph_variants(read, capture) if split else (ALL,)
        # Looked up before every forward: the answer for each of the 8 masks, worked out once.
        self._covering = tuple(next(v for v in self.variants if v & needed == needed) for needed in range(ALL + 1))

    def covering(self, needed: int) -> int:
        """The cheapest captured variant that launches every op in ``needed``."""
        return self._covering[needed]

    @property
    def kinds(self) -> int:
        return self._kinds

    @kinds.setter
    def kinds(self, value: int) -> None:
        if value != self._kinds:
            if self.on_change is not None:
                self.on_change(value)  # first: if it fails, the gate keeps its state and the next set retries
            self._kinds = value


GATE = Gate()

# Launch the CUDA kernels (steer_, read_, capture_) as programmatic dependent launches (set once per worker:
# HOTWIRE_PDL on an NVIDIA GPU of compute capability 9.0 or later). A kernel then starts while the one before it
# drains and waits for it on the device, instead of paying the launch gap between two dependent graph nodes
# (benchmarks/bench_op_graph.py). They read token_cfg and layer_on (read_: token_read, read_slot; capture_:
# token_cap) before that wait: those must only ever be written by copies issued before the forward, never by a
# kernel inside it.
PDL = False


def steer_torch(
    residual: torch.Tensor,
    hidden: torch.Tensor | None,
    token_cfg: torch.Tensor,
    layer_on: torch.Tensor,
    cfg_slot: torch.Tensor,
    cfg_scale: torch.Tensor,
    cfg_rel: torch.Tensor,
    bank: torch.Tensor,
    inv_norm: torch.Tensor,
    layer: int,
    cfg_gate: torch.Tensor | None = None,
    token_read: torch.Tensor | None = None,
    token_pos: torch.Tensor | None = None,
    token_hit: torch.Tensor | None = None,
    gate_row: torch.Tensor | None = None,
    use_norm: bool = True,
) -> torch.Tensor:
    """Return the steered residual (out of place); rows whose config is 0 come back bit-identical, and so does
    every row at a layer whose ``layer_on`` flag is 0, and every row whose entries are all gated off.

    Gates (``cfg_gate`` and the rest, or None): an entry with ``cfg_gate`` set steers a token only where its
    request's condition (``gate_row`` of the token's readout row ``token_read``) let it through: per token, the
    ``token_hit`` the readout op wrote at the condition's layer; latched, from the first position that held.

    Only branch-free, data-independent torch ops, so that Inductor can fuse this into neighbouring kernels
    and it can be captured in a CUDA graph. The loop over K unrolls on a static shape, and it avoids
    materialising a ``[T, K, H]`` gather. ``use_norm=False`` drops the norm-relative term (and its reduction
    over H) for callers that know no entry can be norm-relative.
    """
    n_tokens = residual.shape[0]
    cfg = token_cfg[:n_tokens].long()
    slots = cfg_slot[cfg, layer].long()  # [T, K]
    res32 = residual.float()
    coef = cfg_scale[cfg, layer]  # [T, K]
    if use_norm:
        base = res32 if hidden is None else res32 + hidden.float()
        norm = torch.linalg.vector_norm(base, dim=-1, keepdim=True)  # [T, 1]
        coef = coef + cfg_rel[cfg, layer] * norm * inv_norm[slots]
    steered = (cfg != 0) & (layer_on[layer] != 0)
    if cfg_gate is not None:
        active = slots != 0
        rows = token_read[:n_tokens].long()
        latch = (gate_row[rows, GATE_FLAGS] & GATE_LATCH) != 0
        let_through = torch.where(latch, gate_row[rows, GATE_FIRST] <= token_pos[:n_tokens], token_hit[:n_tokens] != 0)
        active = active & ((cfg_gate[cfg, layer] == 0) | let_through.unsqueeze(-1))
        coef = torch.where(active, coef, torch.zeros_like(coef))
        steered = steered & active.any(dim=1)  # a token whose entries are all gated off keeps its bits
    acc = res32
    for k in range(slots.shape[1]):
        acc = acc + coef[:, k : k + 1] * bank[slots[:, k]].float()
    return torch.where(steered.unsqueeze(-1), acc.to(residual.dtype), residual)


# The kernels take the schema's arguments in order: (residual, hidden, token_cfg, layer_on, cfg_slot, cfg_scale,
# cfg_rel, bank, inv_norm, layer, and the five gate tensors or None), as documented on steer_torch.


def _steer_cpu(residual: torch.Tensor, *args: object) -> None:
    """CPU kernel: unsteered rows are rewritten with their own bits, which leaves them unchanged."""
    if GATE.kinds & STEER:
        residual.copy_(steer_torch(residual, *args))


def _steer_cuda(*args: object) -> None:
    """CUDA kernel: the Triton launcher, imported here so CPU-only processes never import Triton."""
    if GATE.kinds & STEER:
        from hotwire_core.triton_steer import steer_triton_

        steer_triton_(*args, pdl=PDL)


_LIBS: list[torch.library.Library] = []  # each op lives exactly as long as its library: kept for the process


def define_op(name: str, schema: str, cpu: Callable, cuda: Callable) -> None:
    """Register ``torch.ops.hotwire.<name>`` (``schema``; it returns nothing) with its CPU and CUDA kernels, once
    per process. The dispatcher is asked rather than ``torch.ops`` (which caches lookups), so a dropped library is
    seen."""
    try:
        torch._C._dispatch_find_schema_or_throw(f"{OP_NAMESPACE}::{name}", "")
        return
    except RuntimeError:
        pass
    lib = torch.library.Library(OP_NAMESPACE, "FRAGMENT")
    lib.define(schema)
    lib.impl(name, cpu, "CPU")
    lib.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"{OP_NAMESPACE}::{name}", _fake, lib=lib)
    _LIBS.append(lib)


def _fake(*args: object) -> None:
    """Shape propagation for tracing: hotwire's ops only mutate their first argument and return nothing."""
    return None


def register_ops() -> None:
    """Register ``torch.ops.hotwire.steer_``; a no-op when it is already registered in this process."""
    define_op(OP_NAME, _SCHEMA, _steer_cpu, _steer_cuda)


register_ops()
