"""hotwire_core.capture.WorkerCapture on a CPU device with the capture op's torch kernel: which tokens each step
adds to which row, chunked prompts, restarts, incomplete captures, rows handed back, captures handed out once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hotwire_core import handouts
from hotwire_core.capture import WorkerCapture
from hotwire_core.capture_admission import capture_args
from hotwire_core.capture_op import capture_torch
from hotwire_core.contract import CAPTURE_KEY
from hotwire_core.uploader import Uploader

N_LAYERS, H, MAX_TOKENS, ROWS = 4, 8, 32, 2


def worker(layers=(1, 3)) -> WorkerCapture:
    return WorkerCapture(layers, N_LAYERS, H, torch.device("cpu"), MAX_TOKENS, ROWS, Uploader(torch.device("cpu")))


def new_req(req_id, prompt_len, tag, layers=(1, 3), position="last"):
    """A new capture request as ``Step.captures`` lists it."""
    return req_id, prompt_len, capture_args(tag, layers, position)[CAPTURE_KEY]


def step(w, new=(), finished=()):
    w.on_step(set(finished), list(new))


def forward(w, req_ids, scheduled, computed, streams):
    """One step: the fill, then the op at every layer on ``streams[layer]`` (``[tokens, H]``), as hidden alone
    for layer 3 and as hidden + residual (halves) for the others."""
    w.fill(list(req_ids), np.array(scheduled), np.array(computed), sum(scheduled))
    for layer in range(N_LAYERS):
        x = streams[layer]
        if layer == 3:
            capture_torch(x, None, w.token_cap, w.acc, layer)
        else:
            capture_torch(x / 2, x / 2, w.token_cap, w.acc, layer)


def streams_for(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, generator=g) for _ in range(N_LAYERS)]


def take(w, tag):
    out = w.take([tag])["captures"]
    return out.get(tag)


def as_rows(capture):
    return np.frombuffer(capture["data"], np.float32).reshape(len(capture["layers"]), H)


def test_last_and_mean_over_a_chunked_prompt_beside_a_plain_request():
    w = worker()
    step(w, [new_req("m", 5, "tm", position="mean"), new_req("l", 3, "tl")])
    # step 1: plain request "p" (2 tokens), "m" tokens 0-2 of 5, "l" all 3 prompt tokens
    s1 = streams_for(8, 1)
    forward(w, ["p", "m", "l"], [2, 3, 3], [4, 0, 0], s1)
    assert w.token_cap[:8].tolist() == [0, 0, 1, 1, 1, 0, 0, 2]  # rows in the order the requests came
    step(w, finished={"l"})
    # step 2: "m" tokens 3-4 and its first output token (not a prompt token)
    s2 = streams_for(4, 2)
    forward(w, ["m", "p"], [3, 1], [3, 6], s2)
    assert w.token_cap[:4].tolist() == [1, 1, 0, 0]
    step(w, finished={"m"})
    last, mean = take(w, "tl"), take(w, "tm")
    assert last["layers"] == [1, 3] and last["tokens"] == 1
    assert np.allclose(as_rows(last), [s1[1][7].numpy(), s1[3][7].numpy()], atol=1e-6)
    expected = [torch.cat([s1[l][2:5], s2[l][0:2]]).sum(0).numpy() for l in (1, 3)]
    assert mean["tokens"] == 5 and np.allclose(as_rows(mean), expected, atol=1e-5)
    assert take(w, "tm") is None  # handed out once
    assert (w.acc[:, 1:] == 0).all()  # rows are clean for the next capture


def test_rows_come_back_and_token_cap_is_cleared_once_nobody_captures():
    w = worker()
    for i in range(3):  # more captures than rows, one after the other
        step(w, [new_req(f"r{i}", 2, f"t{i}")], finished={f"r{i - 1}"} if i else ())
        forward(w, [f"r{i}"], [2], [0], streams_for(2, i))
    step(w, finished={"r2"})
    assert all(take(w, f"t{i}")["tokens"] == 1 for i in range(3))
    assert not w.clean  # token_cap still holds the last step's row on the device
    w.fill(["p"], np.array([2]), np.array([0]), 2)
    assert w.clean and not w.token_cap.any()


def test_a_complete_capture_is_handed_out_before_the_worker_hears_of_the_finish():
    """vLLM passes finished ids on in the next step, which an idle engine may run after the caller asks: a capture
    whose prompt is complete is taken then, once; its row comes back only with the finish, and nothing is stored."""
    w = worker()
    step(w, [new_req("m", 4, "tm", position="mean"), new_req("h", 4, "th", position="mean")])
    s = streams_for(6, 1)
    forward(w, ["m", "h"], [4, 2], [0, 0], s)  # "h" has seen half of its prompt
    early = take(w, "tm")
    assert early["tokens"] == 4 and np.allclose(as_rows(early)[0], s[1][:4].sum(0).numpy(), atol=1e-5)
    assert take(w, "th") is None  # incomplete: not yet
    assert take(w, "tm") is None and len(w._free) == ROWS - 2  # once; the row is still held
    step(w, finished={"m"})
    assert take(w, "tm") is None and len(w._free) == ROWS - 1 and (w.acc[:, 1:2] == 0).all()


def test_a_restarted_prompt_starts_its_sum_again():
    w = worker()
    step(w, [new_req("m", 4, "tm", position="mean")])
    forward(w, ["m"], [2], [0], streams_for(2, 1))
    step(w, [new_req("m", 4, "tm", position="mean")])  # V2 re-adds a preempted request; V1 recomputes from 0
    s = streams_for(4, 2)
    forward(w, ["m"], [4], [0], s)
    step(w, finished={"m"})
    got = take(w, "tm")
    assert got["tokens"] == 4
    assert np.allclose(as_rows(got)[0], s[1].sum(0).numpy(), atol=1e-5)


def test_a_capture_that_missed_prompt_tokens_is_an_error_not_a_vector():
    w = worker()
    step(w, [new_req("m", 4, "tm", position="mean"), new_req("a", 3, "ta")])
    forward(w, ["m", "a"], [2, 1], [2, 0], streams_for(3, 1))  # m's first two tokens came from elsewhere
    step(w, finished={"m", "a"})  # a was aborted before its last prompt token ran
    assert "2 of the 4" in take(w, "tm")["error"]
    assert "0 of the 1" in take(w, "ta")["error"]


def test_only_this_ranks_layers_are_kept_and_old_captures_expire():
    w = worker(layers=(3,))  # a pipeline rank holding layer 3 only
    step(w, [new_req("a", 1, "ta", layers=(1, 3))])
    forward(w, ["a"], [1], [0], streams_for(1, 1))
    step(w, finished={"a"})
    assert take(w, "ta")["layers"] == [3]
    step(w, [new_req("b", 1, "tb")])
    forward(w, ["b"], [1], [0], streams_for(1, 1))
    step(w, finished={"b"})
    finished_at, result = w.done.kept["tb"]
    w.done.kept["tb"] = (finished_at - handouts.KEEP_S - 1, result)  # as if it had waited past KEEP_S
    w.done.put("tc", {"error": "x"})  # storing a later one drops what expired
    assert take(w, "tb") is None and take(w, "tc") is not None


@pytest.mark.parametrize("n", [1, 5])
def test_capture_op_adds_only_rows_with_a_capture(n):
    acc = torch.zeros(N_LAYERS, 3, H)
    x = torch.randn(n, H)
    cap = torch.tensor([2] + [0] * (MAX_TOKENS - 1), dtype=torch.int32)
    capture_torch(x, None, cap, acc, 2)
    assert torch.equal(acc[2, 2], x[0]) and not acc[2, 1].any() and not acc[[0, 1, 3]].any()


# -- the CUDA kernel: in Triton's interpreter on the CPU, compiled on a GPU --------------------------------------


def check_triton_against_torch(device: str, pdl: bool = False) -> None:
    """``capture_triton_`` adds what ``capture_torch`` adds: with and without a partner, bf16 and float32 streams,
    several tokens into one row (a ``mean`` capture), and a hidden size spanning several blocks. On ``cpu`` it runs
    in Triton's interpreter (the caller sets ``TRITON_INTERPRET``); on ``cuda`` compiled (``pdl``: as a programmatic
    dependent launch)."""
    from hotwire_core import triton_capture

    g = torch.Generator().manual_seed(0)
    for dtype, hidden, with_other, block in ((torch.float32, H, True, None), (torch.bfloat16, 40, False, 16),
                                             (torch.bfloat16, 40, True, 16)):
        saved = triton_capture.MAX_BLOCK_H
        if block is not None:
            triton_capture.MAX_BLOCK_H = block
        try:
            n = 6
            target = torch.randn(n, hidden, generator=g).to(dtype)
            other = torch.randn(n, hidden, generator=g).to(dtype) if with_other else None
            cap = torch.zeros(MAX_TOKENS, dtype=torch.int32)
            cap[:n] = torch.tensor([0, 2, 2, 1, 0, 2], dtype=torch.int32)
            want, got = torch.zeros(N_LAYERS, 3, hidden), torch.zeros(N_LAYERS, 3, hidden, device=device)
            capture_torch(target, other, cap, want, 1)
            want[:, 0] = 0  # row 0 is never read: the kernel skips its tokens
            triton_capture.capture_triton_(target.to(device), None if other is None else other.to(device),
                                           cap.to(device), got, 1, pdl=pdl)
            got = got.cpu()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert got[1, 2].abs().sum() > 0
        finally:
            triton_capture.MAX_BLOCK_H = saved


_INTERPRETER_SCRIPT = f"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_capture
test_capture.check_triton_against_torch("cpu")
"""


def test_triton_kernel_in_interpreter() -> None:
    pytest.importorskip("triton")

    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_cpu_kernel_adds_the_captured_tokens_only():
    from hotwire_core import capture_op
    from hotwire_core.ops import ALL, GATE, IDLE, READ, STEER

    acc = torch.zeros(N_LAYERS, 3, H)
    saved = capture_op._ACC
    capture_op.set_accumulator(acc)
    try:
        x, r = torch.randn(4, H), torch.randn(4, H)
        cap = torch.zeros(MAX_TOKENS, dtype=torch.int32)
        torch.ops.hotwire.capture_(x, r, cap, 1)  # nobody captures
        assert not acc.any()
        cap[:4] = torch.tensor([0, 2, 0, 2], dtype=torch.int32)
        torch.ops.hotwire.capture_(x, r, cap, 1)
        torch.testing.assert_close(acc[1, 2], (x + r)[[1, 3]].sum(0))
        assert not acc[1, :2].any() and not acc[[0, 2, 3]].any()  # row 0 collects nothing on the CPU
        for kinds in (IDLE, STEER | READ):  # a gate without CAPTURE: nothing
            GATE.kinds = kinds
            torch.ops.hotwire.capture_(x, r, cap, 1)
            torch.testing.assert_close(acc[1, 2], (x + r)[[1, 3]].sum(0))
    finally:
        GATE.kinds = ALL
        capture_op.set_accumulator(saved)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pdl", [False, True])
def test_triton_kernel_on_the_gpu_and_under_graph_replay(pdl: bool) -> None:
    """The kernel compiled for the GPU adds what the torch kernel adds, at a model's width, and a captured CUDA graph
    replays it on the buffers' contents at replay time (new streams, new rows), not those of capture; launched
    plainly and as a programmatic dependent launch."""
    from hotwire_core import triton_capture

    if pdl and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    check_triton_against_torch("cuda", pdl=pdl)
    g = torch.Generator().manual_seed(1)
    n, hidden = 64, 2560
    target = torch.zeros(n, hidden, dtype=torch.bfloat16, device="cuda")
    other = torch.zeros_like(target)
    cap = torch.zeros(MAX_TOKENS * 4, dtype=torch.int32, device="cuda")
    acc = torch.zeros(N_LAYERS, 3, hidden, device="cuda")
    triton_capture.capture_triton_(target, other, cap, acc, 1, pdl=pdl)  # compiles before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_capture.capture_triton_(target, other, cap, acc, 1, pdl=pdl)
    t, o = torch.randn(n, hidden, generator=g).bfloat16(), torch.randn(n, hidden, generator=g).bfloat16()
    rows = torch.zeros(MAX_TOKENS * 4, dtype=torch.int32)
    rows[:n] = torch.randint(0, 3, (n,), generator=g, dtype=torch.int32)
    target.copy_(t), other.copy_(o), cap.copy_(rows)
    graph.replay()
    want = torch.zeros(N_LAYERS, 3, hidden)
    capture_torch(t, o, rows, want, 1)
    want[:, 0] = 0
    torch.testing.assert_close(acc.cpu(), want, atol=1e-4, rtol=1e-5)
    assert want[1, 1:].abs().sum() > 0
