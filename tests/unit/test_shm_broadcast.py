"""vLLM's shared-memory message queue with hotwire's bound on a reader's idle wait (``vllm_glue.shm_broadcast``):
a writer's notification dropped (as a PUB socket with a high-water mark of 1 drops it) no longer parks a reader that
waits for its next message with ``indefinite=True``, as a worker waits for its next command. vLLM's own queue,
writer and reader in one process (threads)."""

from __future__ import annotations

import threading
import time

import pytest

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")


@pytest.fixture
def queue_pair():
    from hotwire_core.vllm_glue.shm_broadcast import patch_shm_broadcast

    patch_shm_broadcast(shm_broadcast)  # what the plugin does in every vLLM process
    writer = shm_broadcast.MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    reader = shm_broadcast.MessageQueue.create_from_handle(writer.export_handle(), 0)
    ready = threading.Thread(target=reader.wait_until_ready)
    ready.start()
    writer.wait_until_ready()
    ready.join(10)
    yield writer, reader
    for queue in (reader, writer):
        queue.shutdown()


def test_a_reader_finds_a_message_whose_notification_was_dropped(queue_pair):
    from hotwire_core.vllm_glue.shm_broadcast import RECHECK_MS

    writer, reader = queue_pair
    got: list = []
    reader._spin_condition.last_read = 0.0  # idle for long: the next empty check waits on the notify socket
    thread = threading.Thread(target=lambda: got.append(reader.dequeue(indefinite=True)), daemon=True)
    thread.start()
    time.sleep(0.5)  # the reader is in its poll
    writer._spin_condition.notify = lambda: None  # the notification is lost
    start = time.monotonic()
    writer.enqueue({"method": "sample_tokens"})
    thread.join(RECHECK_MS / 1000 + 5)
    assert got == [{"method": "sample_tokens"}], "the reader stayed parked on a dropped notification"
    assert time.monotonic() - start <= RECHECK_MS / 1000 + 5
