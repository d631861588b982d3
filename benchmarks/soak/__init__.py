"""Soak benchmark: many concurrent clients on every OpenAI route of a real ``vllm serve`` with hotwire, while
steering vectors are registered, replaced and deleted, with every response checked from its content.

What it measures
    Requests, failures by kind, throughput (req/s), latencies (TTFT of streams and total, p50/p99, plain vs
    steered), the API server's own ``GET /health`` beside ``GET /steer/slots?max_age_ms=1000`` (p50/p99, polled
    by a thread of its own, on its own connection), and at the end whether ``/steer/slots`` drains to 0 pinned.
    Writes a JSON report (``--out``) and a table on stdout; exits 1 when any failure count is non-zero
    (``--no-fail-exit``: report only).

How a response tells which vector and version steered it ("marker" vectors)
    Every vector is the direction of one LM-head row ``W_U[T]`` (``lm_head.weight``, or the embeddings when they
    are tied), registered as a ``[hidden]`` vector and steered at the last decoder layer with a scale far above
    the residual stream's own norm (calibrated at start). After the last layer there is only the final RMSNorm
    and the LM head, so the greedy token at every steered position is T, with a margin of several nats that
    batching numerics cannot move, and no KV changes. Hence, at temperature 0 with ``ignore_eos``:

    - one entry for both phases: every generated token is T;
    - ``decode_only``: token 0 is the model's own, every later one is T;
    - ``prefill_only``: token 0 is T (the last prompt token is steered), the rest is the model's own;
    - stacked, A at scale 2s and B at s: the greedy token is T_A and the runner-up (logprobs top-2) is T_B.

    Each id owns a pool of marker tokens (pools are disjoint); a new version of a churned id takes the next
    marker of its pool, so consecutive versions differ in content. The soak keeps (id, version) -> marker from
    the registration answers, and judges every response after the run against its ``x-hotwire-receipt``.
    Marker tokens decode to distinct printable ASCII, none a prefix or suffix of another (so text alone, on
    ``/v1/responses``, tells them apart), and exclude every token (and runner-up) of the prompts' plain answers.
    Completions and chat return token ids (``return_tokens_as_token_ids``); responses are read from their text.

Failure kinds (see :func:`verdicts.classify`)
    ``wrong_vector`` (another id's marker, plain content for a steered request, a marker for a plain one),
    ``wrong_phase`` (a decode_only / prefill_only entry that steered the other phase too), ``receipt_mismatch``
    (the right id but another version than the receipt names, a receipt whose layers / scale / flags differ from
    the request, a missing receipt), ``silent_empty``, ``truncated`` (fewer tokens than ``max_tokens``),
    ``dropped`` (connection closed without a complete response), ``http_error`` (by status and code),
    ``stream_error`` (an error event after the 200), ``timeout``, ``rejected_429``, plus ``churn_error`` (a
    register / replace / delete that failed), ``poll_error`` and ``not_drained``. A 400 ``unknown_vector`` for a
    request one of whose ids was deleted while it was in flight is ``refused_expected``, not a failure.

Traffic
    ``--clients`` asyncio clients, each with its own ``httpx.AsyncClient`` (one keep-alive connection per client,
    as independent users have), spread over ``--client-processes`` spawned processes (default one per 64 clients:
    one asyncio process saturates before a vLLM API server does; the report's ``client_processes_busy`` gives the
    share of a core each used, near 1 meaning the clients may have been the limit; of a server it starts, the
    report's ``server_busy`` gives its API server's and engine core's, and ``--profile S`` py-spies both for S s in
    the middle of the traffic into ``<--out without .json>.<process>.txt``), each looping until
    ``--duration``: a spec class (plain 25 %, single 50 %, stacked
    10 %, decode_only 7.5 %, prefill_only 7.5 %; ``--mix plain|steered`` for throughput comparisons), a route
    (completions / chat completions / responses, uniform; stacked only on the first two), streamed or not
    (50/50), a prompt, and a scale drawn uniformly in [s, 1.5 s]. Two churn tasks replace one churned id every
    ``--replace-every`` s and delete and re-register another every ``--delete-every`` s (also under
    ``--mix plain``). A request whose bank rows are taken waits in the engine for them, whatever the number of
    clients against ``HOTWIRE_SLOTS`` (a server of its own gets ``--slots 16``): a 429 is a failure
    (``rejected_429``).

A fleet (several ``--url``: the replicas of one registry, ``HOTWIRE_REGISTRY``)
    Client i sends to server i mod n; each churned id's changes go through the servers in turn; versions are the
    fleet's, so one book of (id, version) -> marker judges every server's receipts. A re-registered id counts as
    present once every server holds its version (``GET /steer/vectors/ID``; a churn error after
    ``PROPAGATION_TIMEOUT_S``); the time that took is reported (``churn.latency_ms.propagation``). The poller and
    the calibration use the first server; every server must drain.

Run it (from the repository root)::

    # starts its own server (tiny float32 model with random weights; CPU: --enforce-eager), HOTWIRE_SLOTS=16
    python -m benchmarks.soak --duration 60 --out soak.json
    # saturation, plain vs steered throughput: more clients than the engine's batch
    python -m benchmarks.soak --slots 64 --clients 32 --mix plain --out plain.json --server-arg=--max-num-seqs=8
    python -m benchmarks.soak --slots 64 --clients 32 --mix steered --out steered.json --server-arg=--max-num-seqs=8
    # an already running server: --model names the served folder (the LM head weights give the markers)
    python -m benchmarks.soak --url http://127.0.0.1:8000 --model /models/qwen3-8b --clients 64
    # the replicas of a fleet (one Redis registry), each addressed directly
    python -m benchmarks.soak --url http://10.0.0.1:8000 --url http://10.0.0.2:8000 --model /models/qwen3-8b
    # four tenants with the same ids, and one flooding distinct vectors (soak.tenants; --url: an operator --api-key)
    python -m benchmarks.soak --tenants 4 --flood --tenant-rows 16 --slots 64 --clients 16 --duration 60 --out t.json
    # the flood's rounds that get no answer (a dropped connection, a timeout) are failures in the report
    # the flood in every other 60-s window only: the others' p50/p99 and requests per second with and without it,
    # side by side on one server (the report's flood_windows: ratios per tenant and the worst one)
    python -m benchmarks.soak --tenants 4 --flood --flood-windows 60 --tenant-rows 16 --slots 64 --duration 600
    # a bigger model on a GPU, extra server arguments passed through
    python -m benchmarks.soak --model /models/qwen3-8b --server-arg=--max-num-seqs=128 --clients 128
"""

# One job a module, each importing only those above it:
#   steering (entries sent, receipts read) -> markers (the book, choosing markers) -> responses (reading answers)
#   -> verdicts (judging them) -> plan (config, draws, request bodies) -> clients (sending) -> calibration
#   -> churn (vector changes) -> control_plane (poller, drain) -> stats, windows (flood windows) -> report
#   -> run (one soak) -> tenants (several tenants' soaks at once) -> server -> cli; benchmarks.server_processes
#   watches the server from outside
