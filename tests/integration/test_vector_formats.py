"""Vectors users already have, against a real ``vllm serve`` (vLLM 0.25.1, the tiny float32 model; CPU in CI):
a control-vector GGUF (llama.cpp's / repeng's layout) and an SAE feature (SAELens' folder) register and steer
exactly as the same rows registered as safetensors, and as transformers with a hook on the output of the block
the file names; a vector exports as GGUF and safetensors and registers again unchanged; files made for another
model are refused naming what does not fit; a vector extracted from contrastive examples on the server
(``POST /steer/vectors/extract``, the client, ``hotwire extract``) equals the same computation on transformers with
hooks, and what cannot be extracted is refused.

One server serves the module (``--enforce-eager`` on the CPU; torch.compile is covered by test_engine.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch
from safetensors.numpy import save as save_numpy

import hf_reference
from hotwire_api import cli
from hotwire_api.client import HotwireClient
from server_fixture import VllmServer

pytestmark = pytest.mark.integration

HIDDEN, LAYERS = 256, 4  # hotwire_core.tiny_model "tiny"
SERVER_ARGS = [] if torch.cuda.is_available() else ["--enforce-eager"]
# Extracted vectors against transformers, both float32: the CPU's kernels come within 2e-4; a GPU's (graphs on) sum in
# other orders (seen on the H200: 2.1e-4 on a unit-length pca vector).
EXTRACT_ATOL = 5e-4 if torch.cuda.is_available() else 2e-4
TOKENS = [11, 57, 203, 9, 140, 77, 310, 5, 88, 42]  # a prompt as token ids: transformers sees the same
CAPTURE_ROWS, MAX_EXAMPLES, MAX_EXAMPLE_TOKENS = 2, 8, 40  # fewer rows than examples: extraction runs in chunks
POSITIVE = ["I love this, it is wonderful", "What a happy sunny day",
            [{"role": "user", "content": "How was it?"}, {"role": "assistant", "content": "Lovely, thank you!"}]]
NEGATIVE = ["I hate this, it is awful", "What a sad rainy day",
            [{"role": "user", "content": "How was it?"}, {"role": "assistant", "content": "Dreadful, sadly."}]]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[VllmServer]:
    env = {"HOTWIRE_STORE": "off", "HOTWIRE_CAPTURE": "1", "HOTWIRE_CAPTURE_ROWS": str(CAPTURE_ROWS),
           "HOTWIRE_EXTRACT_MAX_EXAMPLES": str(MAX_EXAMPLES), "HOTWIRE_EXTRACT_MAX_TOKENS": str(MAX_EXAMPLE_TOKENS)}
    srv = VllmServer(tiny_model, tmp_path_factory.mktemp("vllm-serve"), env, SERVER_ARGS)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def hf(tiny_model):
    return hf_reference.load(tiny_model)


def rows(seed: int, n: int, width: int = HIDDEN) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def write_gguf(path: Path, directions: dict[str, np.ndarray]) -> bytes:
    """A control vector as llama.cpp's cvector-generator writes one (int32 layer_count; repeng: uint32)."""
    writer = gguf.GGUFWriter(path, "controlvector")
    writer.add_string("controlvector.model_hint", "qwen3")
    writer.add_int32("controlvector.layer_count", len(directions))
    for name, values in directions.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def register_file(http: httpx.Client, vector_id: str, raw: bytes, **fields: str) -> httpx.Response:
    return http.post("/steer/vectors", data={"id": vector_id, **fields}, files={"file": ("v", raw)})


def prompt_logprobs(http: httpx.Client, model: str, hotwire: dict | None = None) -> list[float]:
    """Log-probability of each prompt token after the first, as vLLM computes it (``prompt_logprobs``)."""
    body = {"model": model, "prompt": TOKENS, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    if hotwire is not None:
        body["vllm_xargs"] = {"hotwire": json.dumps(hotwire)}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    entries = response.json()["choices"][0]["prompt_logprobs"]
    values = [entry[str(token)]["logprob"] for token, entry in zip(TOKENS[1:], entries[1:], strict=True)]
    assert all(math.isfinite(v) for v in values)
    return values


def max_diff(a: list[float], b: list[float] | torch.Tensor) -> float:
    return float((torch.tensor(a) - torch.as_tensor(b)).abs().max())


def error(response: httpx.Response, status: int, code: str, field: str | None) -> str:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert (body["code"], body.get("field")) == (code, field), body
    return body["message"]


def test_gguf_steers_as_its_rows_after_the_blocks_it_names(http, tiny_model, hf, tmp_path):
    model = str(tiny_model)
    values = rows(1, 2)
    raw = write_gguf(tmp_path / "cv.gguf", {"direction.3": values[1], "direction.1": values[0]})
    registered = register_file(http, "cv-gguf", raw)
    assert registered.status_code == 201, registered.text
    meta = registered.json()
    assert (meta["layers"], meta["dtype"], meta["shape"]) == ([1, 3], "float32", [2, HIDDEN])
    twin = register_file(http, "cv-st", save_numpy({"1": values[0], "3": values[1]}))
    assert twin.json()["sha256"] == meta["sha256"]

    spec = {"id": "cv-gguf", "layer": [1, 3], "scale": 2.0}
    plain = prompt_logprobs(http, model)
    steered = prompt_logprobs(http, model, spec)
    assert max_diff(prompt_logprobs(http, model, {**spec, "id": "cv-st"}), steered) < 1e-5
    # direction.N is added to the output of block N (0-based), as llama.cpp's build_cvec adds it
    ids = torch.tensor(TOKENS)
    expected = hf_reference.prompt_logprobs(hf, ids.tolist(), [(1, torch.from_numpy(values[0]), 2.0, False),
                                                                (3, torch.from_numpy(values[1]), 2.0, False)])
    assert max_diff(steered, expected) < 2e-3
    assert max_diff(steered, plain) > 2e-2, "the steering in this check is too weak to be seen"
    # and not the input of block N (the output of block N - 1): the check tells the two numberings apart
    shifted = hf_reference.prompt_logprobs(hf, ids.tolist(), [(0, torch.from_numpy(values[0]), 2.0, False),
                                                               (2, torch.from_numpy(values[1]), 2.0, False)])
    assert max_diff(steered, shifted) > 2e-2
    # one layer of the file: that layer's own row
    one = prompt_logprobs(http, model, {"id": "cv-gguf", "layer": 3, "scale": 2.0})
    assert max_diff(one, prompt_logprobs(http, model, {"id": "cv-st", "layer": 3, "scale": 2.0})) < 1e-5


def test_gguf_made_for_another_model_is_refused(http, tmp_path):
    narrow = write_gguf(tmp_path / "narrow.gguf", {"direction.1": rows(2, 1, 128)[0]})
    assert "hidden size (n_embd) is 256" in error(register_file(http, "narrow", narrow), 400, "bad_shape", "file")
    deep = write_gguf(tmp_path / "deep.gguf", {"direction.1": rows(3, 1)[0], "direction.7": rows(4, 1)[0]})
    message = error(register_file(http, "deep", deep), 400, "layer_out_of_range", "file")
    assert "direction.7" in message and "4 decoder layers" in message
    model_file = write_gguf(tmp_path / "model.gguf", {"blk.0.attn_q.weight": rows(5, 1)[0]})
    error(register_file(http, "model-file", model_file), 400, "bad_file", "file")
    assert http.get("/steer/vectors/deep").status_code == 404


def _sae(tmp_path: Path, hook: str, d_in: int = HIDDEN) -> Path:
    folder = tmp_path / f"sae-{hook}-{d_in}"
    folder.mkdir()
    w_dec = rows(6, 16, d_in)
    (folder / "sae_weights.safetensors").write_bytes(save_numpy({
        "W_enc": np.ascontiguousarray(w_dec.T), "b_enc": np.zeros(16, np.float32), "W_dec": w_dec,
        "b_dec": np.zeros(d_in, np.float32)}))
    (folder / "cfg.json").write_text(json.dumps({"d_in": d_in, "d_sae": 16, "architecture": "standard",
                                                 "metadata": {"hook_name": hook}}))
    return folder


def test_sae_feature_steers_as_its_decoder_row(server, http, tiny_model, tmp_path):
    model = str(tiny_model)
    folder = _sae(tmp_path, "blocks.2.hook_resid_pre")  # after decoder layer 1
    files = {"file": ("sae_weights.safetensors", (folder / "sae_weights.safetensors").read_bytes()),
             "sae_cfg": ("cfg.json", (folder / "cfg.json").read_bytes())}
    registered = http.post("/steer/vectors", data={"id": "sae-7", "feature": "7"}, files=files)
    assert registered.status_code == 201, registered.text
    assert registered.json()["layers"] == [1]
    row = rows(6, 16)[7]
    assert register_file(http, "sae-row", save_numpy({"v": row}), layers="1").status_code == 201
    with HotwireClient(server.url) as client:
        assert client.register_sae("sae-7-client", folder, 7).sha256 == registered.json()["sha256"]
    spec = {"id": "sae-7", "layer": 1, "scale": 3.0}
    steered = prompt_logprobs(http, model, spec)
    assert max_diff(prompt_logprobs(http, model, {**spec, "id": "sae-row"}), steered) < 1e-5
    assert max_diff(steered, prompt_logprobs(http, model)) > 2e-2

    late = _sae(tmp_path, "blocks.5.hook_resid_post")
    files = {"file": ("w", (late / "sae_weights.safetensors").read_bytes()), "sae_cfg": ("c", (late / "cfg.json").read_bytes())}
    error(http.post("/steer/vectors", data={"id": "late", "feature": "1"}, files=files), 400, "layer_out_of_range", "sae_cfg")
    mid = _sae(tmp_path, "blocks.1.hook_resid_mid")
    files = {"file": ("w", (mid / "sae_weights.safetensors").read_bytes()), "sae_cfg": ("c", (mid / "cfg.json").read_bytes())}
    error(http.post("/steer/vectors", data={"id": "mid", "feature": "1"}, files=files), 400, "bad_hook", "sae_cfg")


def test_export_round_trips(server, http, tiny_model, tmp_path):
    values = rows(7, 3)
    assert register_file(http, "out", save_numpy({"1": values[0], "2": values[1], "3": values[2]})).status_code == 201
    original = http.get("/steer/vectors/out").json()

    as_gguf = http.get("/steer/vectors/out/file", params={"format": "gguf"})
    assert as_gguf.status_code == 200 and as_gguf.headers["x-hotwire-version"] == "1"
    path = tmp_path / "out.gguf"
    path.write_bytes(as_gguf.content)
    reader = gguf.GGUFReader(path)  # as repeng's import_gguf and llama.cpp's loader read it
    assert bytes(reader.get_field("general.architecture").parts[-1]).decode() == "controlvector"
    assert bytes(reader.get_field("controlvector.model_hint").parts[-1]).decode() == "qwen3"
    assert int(reader.get_field("controlvector.layer_count").parts[-1][0]) == 3
    assert {t.name: np.asarray(t.data).tolist() for t in reader.tensors} == {
        f"direction.{i + 1}": values[i].tolist() for i in range(3)}
    again = register_file(http, "out-from-gguf", as_gguf.content)
    assert again.json()["sha256"] == original["sha256"]

    bf16 = torch.from_numpy(rows(8, LAYERS)).to(torch.bfloat16)
    from safetensors.torch import save as save_torch

    assert register_file(http, "out-bf16", save_torch({"v": bf16})).status_code == 201
    as_st = http.get("/steer/vectors/out-bf16/file")
    assert as_st.headers["content-disposition"] == 'attachment; filename="out-bf16.safetensors"'
    assert register_file(http, "out-bf16-again", as_st.content).json()["sha256"] == \
        http.get("/steer/vectors/out-bf16").json()["sha256"]
    # a row per layer includes layer 0, which llama.cpp refuses: GGUF cannot carry it
    error(http.get("/steer/vectors/out-bf16/file", params={"format": "gguf"}), 400, "not_exportable", "format")
    error(http.get("/steer/vectors/nope/file"), 404, "unknown_vector", "id")
    error(http.get("/steer/vectors/out/file", params={"format": "npy"}), 400, "bad_request", "format")

    # the CLI: export to a .gguf file, register it back
    out = tmp_path / "cli.gguf"
    assert cli.main(["--url", server.url, "export", "out", str(out)]) == 0
    assert out.read_bytes() == as_gguf.content
    assert cli.main(["--url", server.url, "register", "out-cli", str(out)]) == 0
    assert http.get("/steer/vectors/out-cli").json()["sha256"] == original["sha256"]


# -- vectors extracted from contrastive examples -----------------------------------------------------------------


def reference_vector(hf, tiny_model, layers: list[int], method: str, position: str) -> np.ndarray:
    """The same extraction on transformers: the examples tokenized as the server does, each decoder layer's output
    read by a hook, the arithmetic of hotwire_core.extraction."""
    from transformers import AutoTokenizer

    from hotwire_core.extraction import example_token_ids, extract

    tok = AutoTokenizer.from_pretrained(str(tiny_model))

    def acts(examples):
        out = []
        for example in examples:
            per_layer = hf_reference.layer_outputs(hf, example_token_ids(tok, example), layers)
            out.append([(per_layer[l][-1] if position == "last" else per_layer[l].mean(0)).double().numpy()
                        for l in layers])
        return np.array(out)

    return extract(acts(POSITIVE), acts(NEGATIVE), layers, method)[0]


def exported_rows(http: httpx.Client, vector_id: str) -> np.ndarray:
    from safetensors.numpy import load as load_numpy

    tensors = load_numpy(http.get(f"/steer/vectors/{vector_id}/file").content)
    return np.stack([tensors[k] for k in sorted(tensors, key=int)]) if len(tensors) > 1 else next(iter(tensors.values()))


def test_extract_route_registers_what_transformers_hooks_give(server, http, tiny_model, hf):
    body = {"id": "joy", "positive": POSITIVE, "negative": NEGATIVE, "layers": "1-3", "position": "mean"}
    response = http.post("/steer/vectors/extract", json=body)
    assert response.status_code == 201, response.text
    result = response.json()
    assert (result["vector"]["layers"], result["vector"]["version"]) == ([1, 2, 3], 1)
    assert [r["layer"] for r in result["layers"]] == [1, 2, 3] and result["examples"] == {"positive": 3, "negative": 3}
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["norm"] > 0 for r in result["layers"])
    expected = reference_vector(hf, tiny_model, [1, 2, 3], "mean_diff", "mean")
    got = exported_rows(http, "joy")
    assert np.abs(got - expected).max() < EXTRACT_ATOL, np.abs(got - expected).max()
    assert np.abs(expected).max() > 0.05
    # an ordinary registration: it steers, and extracting again under the id needs replace (a new version)
    assert max_diff(prompt_logprobs(http, str(tiny_model), {"id": "joy", "layer": 2, "scale": 4.0}),
                    prompt_logprobs(http, str(tiny_model))) > 2e-2
    error(http.post("/steer/vectors/extract", json=body), 409, "exists", "id")
    with HotwireClient(server.url) as client:
        again = client.extract("joy", POSITIVE, NEGATIVE, range(1, 4), method="pca", position="last", normalize=True,
                               replace=True)
    assert again.vector.version == 2
    got = exported_rows(http, "joy")
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert np.abs(got - reference_vector(hf, tiny_model, [1, 2, 3], "pca", "last")).max() < EXTRACT_ATOL


def test_cli_extract_reads_jsonl(server, http, tmp_path, capsys):
    path = tmp_path / "examples.jsonl"
    path.write_text("\n".join(json.dumps({"positive": p, "negative": n}) for p, n in zip(POSITIVE, NEGATIVE)) + "\n")
    code = cli.main(["--url", server.url, "extract", "cli-joy", "--jsonl", str(path), "--layers", "0,3",
                     "--method", "pca"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert json.loads(out.out)["vector"]["layers"] == [0, 3]
    assert http.get("/steer/vectors/cli-joy").json()["layers"] == [0, 3]
    path.write_text('{"neutral": "x"}\n')
    assert cli.main(["--url", server.url, "extract", "cli-bad", "--jsonl", str(path)]) == 2
    assert "positive and/or negative" in capsys.readouterr().err


@pytest.mark.parametrize("change, status, code, field", [
    ({"positive": []}, 400, "empty_examples", "positive"),
    ({"method": "pca", "negative": NEGATIVE[:2]}, 400, "unpaired_examples", "negative"),
    ({"layers": [1, 7]}, 400, "layer_out_of_range", "layers"),
    ({"layers": "x"}, 400, "bad_layers", "layers"),
    ({"method": "lda"}, 400, "bad_request", "method"),
    ({"positive": POSITIVE * 2}, 400, "too_many_examples", "positive"),  # 9 > HOTWIRE_EXTRACT_MAX_EXAMPLES
    ({"negative": ["word " * 60]}, 400, "example_too_long", "negative[0]"),  # > HOTWIRE_EXTRACT_MAX_TOKENS
    ({"positive": [[{"role": "user"}]]}, 400, "bad_request", "positive.0.str"),
    ({"id": "../x"}, 400, "bad_request", "id"),
])
def test_what_cannot_be_extracted_is_refused_and_registers_nothing(http, change, status, code, field):
    body = {"id": "refused", "positive": POSITIVE, "negative": NEGATIVE, **change}
    error(http.post("/steer/vectors/extract", json=body), status, code, field)
    assert http.get("/steer/vectors/refused").status_code == 404
    assert http.get("/steer/slots").json()["model"]["capture_rows"] == CAPTURE_ROWS


def test_a_capture_cannot_be_smuggled_in_through_vllm_xargs(http, tiny_model):
    body = {"model": str(tiny_model), "prompt": TOKENS, "max_tokens": 1,
            "vllm_xargs": {"hotwire.capture": json.dumps({"tag": "t", "layers": [1], "position": "last"})}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert "POST /steer/vectors/extract" in response.text
