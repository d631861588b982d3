"""hotwire_core.uploader.Uploader: host-to-device copies staged in a pinned ring."""

from __future__ import annotations

import pytest
import torch

from hotwire_core.uploader import Uploader


def test_cpu_device_copies_plainly():
    up = Uploader(torch.device("cpu"))
    dst = torch.zeros(4, dtype=torch.int32)
    up.copy_(dst, torch.arange(4, dtype=torch.int32))
    assert dst.tolist() == [0, 1, 2, 3]
    host = torch.ones(3)
    assert up.to_device(host) is host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ring_never_overwrites_a_copy_the_gpu_has_not_run():
    up = Uploader(torch.device("cuda"), ring_bytes=1024)  # 400-byte values take 448: the ring comes round every 2
    dsts = [torch.zeros(100, dtype=torch.int32, device="cuda") for _ in range(9)]
    torch.cuda._sleep(200_000_000)  # keeps the stream busy: every copy below is still pending when the next is staged
    for i, dst in enumerate(dsts):
        up.copy_(dst, torch.full((100,), i, dtype=torch.int32))
    moved = [up.to_device(torch.full((100,), 100 + i, dtype=torch.bfloat16)) for i in range(3)]
    big = up.to_device(torch.arange(1000, dtype=torch.int32))  # larger than the ring: a pinned copy of its own
    torch.cuda.synchronize()
    assert [dst.unique().tolist() for dst in dsts] == [[i] for i in range(9)]
    assert [m.unique().tolist() for m in moved] == [[100.0], [101.0], [102.0]] and moved[0].dtype == torch.bfloat16
    assert torch.equal(big.cpu(), torch.arange(1000, dtype=torch.int32))
