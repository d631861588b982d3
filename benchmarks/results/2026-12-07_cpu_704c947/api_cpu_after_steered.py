"""Does a hotwire API server's CPU per plain request rise after it served steered traffic (AZ)? Plain batches on
both servers, then steered traffic with a scale drawn per request on hotwire, then plain batches again."""
import asyncio, json, random, sys, tempfile, time
from pathlib import Path
import httpx
from benchmarks.bench_api_cpu import cpu_ms_per_request, send
from benchmarks.bench_throughput import model_facts, servers, register_vectors
from benchmarks.server_processes import cpu_s
from hotwire_core.tiny_model import build_model


async def steered(url, model, count, concurrency, ids, layer):
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def one():
            async with gate:
                spec = {"id": rng.choice(ids), "layer": layer, "scale": 4.0 * (1 + 0.5 * rng.random())}
                body = {"model": model, "prompt": "The quick brown fox jumps over", "max_tokens": 1,
                        "temperature": 0, "vllm_xargs": {"hotwire": json.dumps(spec)}}
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text[:200]
        await asyncio.gather(*(one() for _ in range(count)))


def main():
    workdir = Path(tempfile.mkdtemp(prefix="drift-"))
    model = build_model(workdir / "tiny", "tiny", weights=True)
    n, conc = int(sys.argv[1]), 8
    rows = []
    with servers(model, ["--dtype", "float32", "--max-model-len", "4096"], workdir, 16) as started:
        name, hidden, n_layers = model_facts(started["hotwire"][0])
        ids = [f"v{i}" for i in range(4)]
        register_vectors(started["hotwire"][0], ids, hidden, 0)
        def plain(tag):
            for r in range(3):
                for server in ("vanilla", "hotwire") if r % 2 == 0 else ("hotwire", "vanilla"):
                    url, pid = started[server]
                    ms, _ = cpu_ms_per_request(pid, url, name, 400, conc, 1, False)
                    rows.append((tag, server, ms))
                    print(f"{tag} {server} {ms:.3f} ms", flush=True)
        plain("before")
        url, pid = started["hotwire"]
        t, c = time.monotonic(), cpu_s(pid)
        asyncio.run(steered(url, name, n, conc, ids, n_layers // 2))
        print(f"steered {n}: {(cpu_s(pid) - c) * 1000 / n:.3f} ms per request, {time.monotonic() - t:.1f} s", flush=True)
        plain("after")
    for tag in ("before", "after"):
        for server in ("vanilla", "hotwire"):
            v = sorted(ms for t, s, ms in rows if t == tag and s == server)
            print(f"median {tag} {server}: {v[1]:.3f} ms ({', '.join(f'{x:.3f}' for x in v)})")


if __name__ == "__main__":
    main()
