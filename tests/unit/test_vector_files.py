"""GGUF control vectors (hotwire_api.gguf_codec) and SAE features (hotwire_api.sae_codec): files laid out as
llama.cpp's cvector-generator, repeng's export_gguf and SAELens write them decode to the right rows and layers;
exports load back unchanged; what does not fit is refused with the right status, code and field."""

from __future__ import annotations

import json
import struct
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import save as save_numpy
from safetensors.torch import save as save_torch

from hotwire_api.codec import VectorPayload, decode_safetensors
from hotwire_api.errors import HotwireError
from hotwire_api.forms import check_fits, decode_form
from hotwire_api.gguf_codec import decode_gguf, encode_gguf, encode_safetensors
from hotwire_api.sae_codec import bytes_reader, decode_sae, hook_layer, read_sae_folder

HIDDEN, N_LAYERS = 8, 6


def _refused(call, *args) -> HotwireError:
    with pytest.raises(HotwireError) as info:
        call(*args)
    assert info.value.status == 400, info.value
    return info.value


def _rows(seed: int, n: int, width: int = HIDDEN) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def _gguf(tmp_path: Path, tensors: dict[str, np.ndarray], arch: str = "controlvector", count=None) -> bytes:
    """A GGUF written as llama.cpp's cvector-generator and repeng's export_gguf write theirs (``count``: how
    layer_count is written, ("int32", n) as llama.cpp, ("uint32", n) as repeng)."""
    path = tmp_path / "v.gguf"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_string(f"{arch}.model_hint", "llama")
    kind, n = count or ("int32", len(tensors))
    getattr(writer, f"add_{kind}")(f"{arch}.layer_count", n)
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


# ---- GGUF in ----------------------------------------------------------------------------------------------


def test_llama_cpp_layout_decodes_direction_n_as_layer_n(tmp_path: Path) -> None:
    rows = _rows(1, N_LAYERS - 1)  # the generator writes direction.1 .. direction.(n_layer - 1)
    raw = _gguf(tmp_path, {f"direction.{i + 1}": rows[i] for i in range(N_LAYERS - 1)})
    payload = decode_gguf(raw)
    assert payload == VectorPayload(rows.tobytes(), "float32", (N_LAYERS - 1, HIDDEN), tuple(range(1, N_LAYERS)))
    assert (payload.kind, payload.source) == ("gguf", "file")


def test_repeng_layout_with_layer_zero_and_unordered_layers(tmp_path: Path) -> None:
    rows = _rows(2, 3)
    raw = _gguf(tmp_path, {"direction.4": rows[0], "direction.0": rows[1], "direction.2": rows[2]}, count=("uint32", 3))
    payload = decode_gguf(raw)
    assert payload.layers == (0, 2, 4)
    assert np.array_equal(np.frombuffer(payload.data, "<f4").reshape(3, HIDDEN), rows[[1, 2, 0]])


def test_directions_naming_one_layer_are_summed_in_float32(tmp_path: Path) -> None:
    rows = _rows(3, 3)
    raw = _gguf(tmp_path, {"direction.3": rows[0], "direction.03": rows[1], "direction.5": rows[2]})
    payload = decode_gguf(raw)
    assert payload.layers == (3, 5)
    got = np.frombuffer(payload.data, "<f4").reshape(2, HIDDEN)
    assert np.array_equal(got[0], rows[0] + rows[1]) and np.array_equal(got[1], rows[2])


def test_gguf_refusals(tmp_path: Path) -> None:
    row = _rows(4, 1)[0]
    assert "general.architecture 'llama'" in _refused(decode_gguf, _gguf(tmp_path, {"direction.1": row}, "llama")).message
    err = _refused(decode_gguf, _gguf(tmp_path, {"blk.1.attn_q.weight": row}))
    assert (err.code, err.field) == ("bad_file", "file") and "direction.N" in err.message
    assert _refused(decode_gguf, _gguf(tmp_path, {"direction.1": row.astype(np.float16)})).code == "bad_dtype"
    assert _refused(decode_gguf, _gguf(tmp_path, {"direction.1": _rows(5, 2)})).code == "bad_shape"
    ragged = _gguf(tmp_path, {"direction.1": row, "direction.2": _rows(6, 1, HIDDEN + 1)[0]})
    assert _refused(decode_gguf, ragged).code == "bad_shape"
    assert "no direction tensors" in _refused(decode_gguf, _gguf(tmp_path, {})).message
    good = _gguf(tmp_path, {"direction.1": row})
    assert "cut short" in _refused(decode_gguf, good[:40]).message
    assert "not a readable GGUF" in _refused(decode_gguf, good[:-4]).message  # its data runs past the end
    big_endian = good[:4] + struct.pack(">I", 3) + good[8:]
    assert "big-endian" in _refused(decode_gguf, big_endian).message


def test_a_header_claiming_more_than_the_file_holds_is_refused_at_once() -> None:
    """An array of 2**60 uint8 entries, or 2**40 strings, in a body of a few dozen bytes: refused by the bounds
    walk, where gguf.GGUFReader alone would loop on entries past the end of the file."""

    def kv(value_type: int, payload: bytes) -> bytes:
        key = b"x"
        return struct.pack("<Q", len(key)) + key + struct.pack("<I", value_type) + payload

    for array in (struct.pack("<IQ", 0, 1 << 60), struct.pack("<IQ", 8, 1 << 40) + struct.pack("<Q", 0) * 4):
        raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv(9, array)
        started = time.monotonic()
        assert "cut short" in _refused(decode_gguf, raw).message
        assert time.monotonic() - started < 1.0

    # Counts that fit in the body but that no control vector needs: gguf's reader would build numpy views for each
    # of the million entries (a 1 MB body is decoded inline, on the event loop), or for each of 100,000 keys.
    million = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv(9, struct.pack("<IQ", 0, 1_000_000) + bytes(1_000_000))
    started = time.monotonic()
    assert "array of 1000000 entries" in _refused(decode_gguf, million).message
    keys = b"GGUF" + struct.pack("<IQQ", 3, 0, 100_000) + kv(0, b"\x00") * 100_000
    assert "100000 metadata keys" in _refused(decode_gguf, keys).message
    assert time.monotonic() - started < 1.0


def test_form_tells_gguf_from_safetensors(tmp_path: Path) -> None:
    rows = _rows(7, 2)
    raw = _gguf(tmp_path, {"direction.1": rows[0], "direction.2": rows[1]})
    vector_id, payload = decode_form({"id": "g", "file": raw})
    assert vector_id == "g" and payload == decode_gguf(raw)
    assert _refused(decode_form, {"id": "g", "file": raw, "layers": "1,2"}).field == "layers"
    _, plain = decode_form({"id": "s", "file": save_numpy({"v": rows[0]})})
    assert plain.kind == "" and plain.layers is None


# ---- GGUF and safetensors out -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gguf_export_round_trips_and_carries_the_fields_the_loaders_read(dtype: str) -> None:
    rows = _rows(8, 3)
    data = torch.from_numpy(rows).to(getattr(torch, dtype))
    payload = VectorPayload(data.contiguous().view(torch.uint8).numpy().tobytes(), dtype, (3, HIDDEN), (1, 3, 5))
    raw = encode_gguf(payload, "happy", "llama", N_LAYERS)
    back = decode_gguf(raw)
    assert back.layers == (1, 3, 5) and back.dtype == "float32"
    assert np.array_equal(np.frombuffer(back.data, "<f4").reshape(3, HIDDEN), data.float().numpy())
    assert encode_gguf(back, "happy", "llama", N_LAYERS) == raw  # re-imported and exported: the same file

    with tempfile.TemporaryFile() as spool:  # read as repeng's import_gguf reads it
        spool.write(raw)
        spool.flush()
        reader = gguf.GGUFReader(spool)
    fields = {name: reader.get_field(name) for name in ("general.architecture", "controlvector.model_hint",
                                                         "controlvector.layer_count")}
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "controlvector"
    assert bytes(fields["controlvector.model_hint"].parts[-1]).decode() == "llama"  # repeng's import needs it
    assert int(fields["controlvector.layer_count"].parts[-1][0]) == 3
    assert [t.name for t in reader.tensors] == ["direction.1", "direction.3", "direction.5"]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 and list(t.shape) == [HIDDEN] for t in reader.tensors)


def test_gguf_export_of_a_row_per_layer_names_every_layer_and_refuses_what_gguf_cannot_carry() -> None:
    rows = _rows(9, N_LAYERS)
    every = VectorPayload(rows.tobytes(), "float32", (N_LAYERS, HIDDEN), None)
    err = _refused(encode_gguf, every, "v", "llama", N_LAYERS)
    assert (err.code, err.field) == ("not_exportable", "format") and "direction.0" in err.message
    anywhere = VectorPayload(rows[0].tobytes(), "float32", (HIDDEN,), None)
    assert "[hidden]" in _refused(encode_gguf, anywhere, "v", "llama", N_LAYERS).message
    without_zero = VectorPayload(rows[1:].tobytes(), "float32", (N_LAYERS - 1, HIDDEN), tuple(range(1, N_LAYERS)))
    assert decode_gguf(encode_gguf(without_zero, "v", "llama", N_LAYERS)) == without_zero


@pytest.mark.parametrize(
    "dtype, shape, layers",
    [("float32", (HIDDEN,), None), ("bfloat16", (N_LAYERS, HIDDEN), None), ("float16", (2, HIDDEN), (2, 4)),
     ("float32", (1, HIDDEN), (3,))],
)
def test_safetensors_export_registers_again_unchanged(dtype: str, shape: tuple[int, ...], layers) -> None:
    data = np.random.default_rng(10).integers(0, 2**14, size=int(np.prod(shape)), dtype=np.uint16)
    raw_values = data.astype("<u2").tobytes() if dtype != "float32" else _rows(10, 1, int(np.prod(shape))).tobytes()
    payload = VectorPayload(raw_values, dtype, shape, layers)
    assert decode_safetensors(encode_safetensors(payload)) == payload


def test_check_fits_names_the_gguf_tensors_and_the_sae_hook(tmp_path: Path) -> None:
    gguf_payload = decode_gguf(_gguf(tmp_path, {"direction.2": _rows(11, 1)[0], "direction.9": _rows(12, 1)[0]}))
    err = _refused(check_fits, gguf_payload, N_LAYERS, HIDDEN)
    assert (err.code, err.field) == ("layer_out_of_range", "file") and "direction.9" in err.message
    assert "hidden size (n_embd) is 16" in _refused(check_fits, gguf_payload, 10, 16).message
    check_fits(gguf_payload, 10, HIDDEN)
    sae = VectorPayload(bytes(4 * HIDDEN), "float32", (1, HIDDEN), (7,), "file", "sae")
    assert _refused(check_fits, sae, N_LAYERS, HIDDEN).field == "sae_cfg"
    assert "d_in 8" in _refused(check_fits, sae, 10, 16).message


# ---- SAE features -----------------------------------------------------------------------------------------


def _sae_folder(tmp_path: Path, hook: str, d_sae: int = 12, dtype=torch.float32, legacy: bool = False) -> Path:
    """A folder as SAELens' ``SAE.save_model`` writes it (legacy: SAELens before 6, hook_name at the top)."""
    folder = tmp_path / hook.replace(".", "_")
    folder.mkdir(exist_ok=True)
    generator = torch.Generator().manual_seed(13)
    w_dec = torch.randn(d_sae, HIDDEN, generator=generator).to(dtype)
    tensors = {"W_enc": w_dec.T.contiguous(), "b_enc": torch.zeros(d_sae, dtype=dtype), "W_dec": w_dec,
               "b_dec": torch.zeros(HIDDEN, dtype=dtype)}
    (folder / "sae_weights.safetensors").write_bytes(save_torch(tensors))
    cfg = {"d_in": HIDDEN, "d_sae": d_sae, "dtype": "float32", "architecture": "standard",
           "metadata": {"hook_name": hook, "model_name": "tiny"}}
    if legacy:
        cfg = {"d_in": HIDDEN, "d_sae": d_sae, "hook_name": hook, "hook_layer": 2, "hook_head_index": None}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("hook, layer", [("blocks.2.hook_resid_post", 2), ("blocks.3.hook_resid_pre", 2),
                                         ("blocks.0.hook_resid_post", 0)])
def test_hook_points_after_a_decoder_layer(hook: str, layer: int) -> None:
    assert hook_layer(hook) == layer


@pytest.mark.parametrize("hook", ["blocks.0.hook_resid_pre", "blocks.2.hook_resid_mid", "blocks.2.attn.hook_z",
                                  "blocks.2.hook_mlp_out", "model.layers.2"])
def test_other_hook_points_are_refused(hook: str) -> None:
    err = _refused(hook_layer, hook)
    assert (err.code, err.field) == ("bad_hook", "sae_cfg")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("legacy", [False, True])
def test_sae_feature_is_its_decoder_row_at_the_hook_layer(tmp_path: Path, dtype, legacy: bool) -> None:
    folder = _sae_folder(tmp_path, "blocks.3.hook_resid_pre", dtype=dtype, legacy=legacy)
    payload = read_sae_folder(folder, 5)
    from safetensors.torch import load_file

    expected = load_file(folder / "sae_weights.safetensors")["W_dec"][5]
    assert payload.layers == (2,) and payload.shape == (1, HIDDEN) and payload.kind == "sae"
    assert payload.data == expected.contiguous().view(torch.uint8).numpy().tobytes()
    assert payload.dtype == {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    # the upload: both files and the index in a form decode to the same vector
    cfg, weights = (folder / "cfg.json").read_bytes(), (folder / "sae_weights.safetensors").read_bytes()
    assert decode_form({"id": "f", "file": weights, "sae_cfg": cfg, "feature": "5"}) == ("f", payload)
    assert decode_form({"id": "f", "file": weights, "sae_cfg": cfg.decode(), "feature": "5"}) == ("f", payload)


def test_sae_refusals(tmp_path: Path) -> None:
    folder = _sae_folder(tmp_path, "blocks.1.hook_resid_post")
    cfg, weights = (folder / "cfg.json").read_bytes(), (folder / "sae_weights.safetensors").read_bytes()
    form = {"id": "f", "file": weights, "sae_cfg": cfg, "feature": "3"}
    assert _refused(decode_form, {**form, "feature": "12"}).field == "feature"  # d_sae is 12
    assert _refused(decode_form, {**form, "feature": "-1"}).code == "bad_feature"
    assert _refused(decode_form, {**form, "feature": "x"}).code == "bad_feature"
    assert _refused(decode_form, {k: v for k, v in form.items() if k != "sae_cfg"}).field == "sae_cfg"
    assert _refused(decode_form, {k: v for k, v in form.items() if k != "feature"}).field == "feature"
    assert _refused(decode_form, {**form, "layers": "1"}).field == "layers"
    assert _refused(decode_form, {**form, "sae_cfg": b"{"}).field == "sae_cfg"
    no_hook = json.dumps({"d_in": HIDDEN, "d_sae": 12, "metadata": {}})
    assert "hook point" in _refused(decode_form, {**form, "sae_cfg": no_hook}).message
    wrong_size = json.dumps({"d_in": HIDDEN, "d_sae": 13, "metadata": {"hook_name": "blocks.1.hook_resid_post"}})
    assert _refused(decode_form, {**form, "sae_cfg": wrong_size}).code == "bad_shape"
    no_decoder = save_numpy({"W_enc": np.zeros((HIDDEN, 12), np.float32)})
    assert "no W_dec" in _refused(decode_form, {**form, "file": no_decoder}).message
    (length,) = struct.unpack("<Q", weights[:8])
    w_dec_end = 8 + length + json.loads(weights[8:8 + length])["W_dec"]["data_offsets"][1]
    assert "beyond the file's end" in _refused(decode_form, {**form, "file": weights[:w_dec_end - 1]}).message
    assert _refused(decode_form, {**form, "file": b"\x00" * 4}).field == "file"
    assert _refused(decode_sae, cfg, bytes_reader(b"\xff" * 16), 16, 0).field == "file"
    for header in (b"5", b'[1, "a"]'):  # JSON, but not a safetensors header: a 400, not a TypeError
        not_a_header = struct.pack("<Q", len(header)) + header
        assert _refused(decode_form, {**form, "file": not_a_header}).message.endswith(
            "is not a safetensors file; send the SAE's sae_weights.safetensors")


def test_a_large_sae_upload_decodes_in_another_process_as_in_place(tmp_path: Path) -> None:
    """An SAE's weights file over uploads.INLINE_BYTES goes to the decoding process; the payload, its layer and
    its kind (which the route checks against the model) come back as the in-place decode gives them."""
    import asyncio

    import httpx

    from hotwire_api import uploads

    folder = _sae_folder(tmp_path, "blocks.2.hook_resid_post", d_sae=40_000)
    request = httpx.Request("POST", "http://x/steer/vectors", data={"id": "big", "feature": "39999"}, files={
        "file": ("w", (folder / "sae_weights.safetensors").read_bytes()), "sae_cfg": ("c", (folder / "cfg.json").read_bytes())})
    body = request.read()
    assert len(body) > uploads.INLINE_BYTES
    content_type = request.headers["content-type"]
    far = asyncio.run(uploads.decode_upload(content_type, body, 1 << 30))
    near = asyncio.run(uploads._decode(content_type, body, 1 << 30))
    assert far == near == ("big", read_sae_folder(folder, 39999))
    assert (far[1].kind, far[1].layers, far[1].source) == ("sae", (2,), "file")
