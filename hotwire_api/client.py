"""Python clients for the ``/steer`` API: :class:`HotwireClient` (sync) and :class:`AsyncHotwireClient`, over httpx.

Errors raise :class:`~hotwire_api.errors.HotwireError` with the server's status, code and message. Vectors go up
as safetensors, control-vector GGUF or JSON only; pickled tensors (``.pt``) are refused before anything is sent.
An SAE feature is read here from the SAE's folder (only its decoder row) and goes up as safetensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union
from urllib.parse import quote

import httpx
import numpy as np

from hotwire_api.codec import CONVERT_HINT
from hotwire_api.completion import Steering, completion_body, completion_of
from hotwire_api.errors import HotwireError
from hotwire_api.gguf_codec import encode_safetensors
from hotwire_api.headers import KEY_HEADER
from hotwire_api.sae_codec import read_sae_folder
from hotwire_api.models import (Completion, DeleteResult, ExtractResult, FleetView, Monitor, MonitorList, SlotStats,
                                VectorList, VectorMeta)

if TYPE_CHECKING:
    import torch

__all__ = ["KEEPALIVE_S", "AsyncHotwireClient", "HotwireClient", "HotwireError", "VectorSource"]

DEFAULT_URL = "http://localhost:8000"
# Below vLLM's server-side keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a connection idle as long as the server
# allows may be closed under the next request (docs/deployment.md, "Idle connections").
KEEPALIVE_S = 3.0
_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_S)  # httpx's sizes
VectorSource = Union[str, os.PathLike, np.ndarray, "torch.Tensor"]
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle")


@dataclass
class _Call:
    method: str
    path: str
    params: dict[str, str] | None = None
    json_body: Any = None
    data: dict[str, str] | None = None
    files: dict[str, tuple[str, bytes, str]] | None = None

    def request_args(self, url: str, headers: dict[str, str]) -> dict[str, Any]:
        """Keyword arguments of ``httpx`` ``request`` (sync and async alike) for this call against ``url``."""
        return dict(method=self.method, url=url + self.path, params=self.params, json=self.json_body,
                    data=self.data, files=self.files, headers=headers)


def _slots_call(max_age_ms: int) -> _Call:
    return _Call("GET", "/steer/slots", params={"max_age_ms": str(max_age_ms)} if max_age_ms else None)


def _to_safetensors(source: Any) -> bytes:
    if type(source).__module__.startswith("torch"):
        import torch
        from safetensors.torch import save as save_torch

        tensor = source.detach().cpu().contiguous()
        return save_torch({"vector": tensor.float() if tensor.dtype == torch.float64 else tensor})
    if isinstance(source, np.ndarray):
        from safetensors.numpy import save as save_numpy

        return save_numpy({"vector": np.ascontiguousarray(source, np.float32 if source.dtype == np.float64 else None)})
    raise TypeError(f"expected a .safetensors/.json path, a numpy array or a torch tensor, got {type(source).__name__}")


def _register_call(vector_id: str, source: VectorSource, layers: Sequence[int] | None, replace: bool) -> _Call:
    params = {"replace": "true"} if replace else None
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        suffix = path.suffix.lower()
        if suffix in _PICKLE_SUFFIXES:
            raise ValueError(
                f"{path}: pickled tensors are not accepted (the server never loads pickles); {CONVERT_HINT}"
            )
        if suffix == ".json":
            payload = json.loads(path.read_text())
            if not isinstance(payload, dict):
                raise ValueError(f"{path}: expected a JSON object in the registration format")
            if payload.get("id", vector_id) != vector_id:
                raise ValueError(f"{path} registers id {payload['id']!r}, not {vector_id!r}")
            if layers is not None and "layers" in payload:
                raise ValueError(f"{path} already names its layers; do not pass layers as well")
            payload = {**payload, "id": vector_id, **({"layers": list(layers)} if layers is not None else {})}
            return _Call("POST", "/steer/vectors", params, json_body=payload)
        if path.is_dir():
            raise ValueError(f"{path} is a folder; an SAE folder registers one feature: register_sae (CLI: --feature)")
        if suffix not in (".safetensors", ".gguf"):
            raise ValueError(f"{path}: expected a .safetensors, .gguf or .json file")
        if suffix == ".gguf" and layers is not None:
            raise ValueError(f"{path}: a GGUF control vector names its layers (direction.N); do not pass layers")
        raw, filename = path.read_bytes(), path.name
    else:
        raw, filename = _to_safetensors(source), f"{vector_id}.safetensors"
    data = {"id": vector_id}
    if layers is not None:
        data["layers"] = ",".join(str(layer) for layer in layers)
    files = {"file": (filename, raw, "application/octet-stream")}
    return _Call("POST", "/steer/vectors", params, data=data, files=files)


def _sae_call(vector_id: str, folder: str | os.PathLike, feature: int, replace: bool) -> _Call:
    try:
        raw = encode_safetensors(read_sae_folder(folder, feature))  # the row, named by its layer
    except HotwireError as err:  # found here, before anything is sent: a local error, as a bad file is
        raise ValueError(f"{folder}: {err.field}: {err.message}") from None
    files = {"file": (f"{vector_id}.safetensors", raw, "application/octet-stream")}
    return _Call("POST", "/steer/vectors", {"replace": "true"} if replace else None, data={"id": vector_id}, files=files)


def _file_call(vector_id: str, file_format: str, version: int | None) -> _Call:
    params = {"format": file_format, **({"version": str(version)} if version is not None else {})}
    return _Call("GET", _vector_path(vector_id) + "/file", params=params)


def _extract_call(vector_id: str, positive: Sequence[Any], negative: Sequence[Any], layers: Any, method: str,
                  position: str, normalize: bool, replace: bool) -> _Call:
    if isinstance(layers, range):
        if layers.step != 1 or not layers:
            raise ValueError(f"layers as a range must be non-empty with step 1, got {layers!r}")
        layers = f"{layers.start}-{layers.stop - 1}"
    elif not isinstance(layers, str):
        layers = [int(layer) for layer in layers]
    body = {"id": vector_id, "positive": list(positive), "negative": list(negative), "layers": layers,
            "method": method, "position": position, "normalize": normalize, "replace": replace}
    return _Call("POST", "/steer/vectors/extract", json_body=body)


def _monitor_call(monitor: Monitor | dict[str, Any], replace: bool) -> _Call:
    body = Monitor.model_validate(monitor).model_dump()  # checked before sending
    return _Call("POST", "/steer/monitors", {"replace": "true"} if replace else None, json_body=body)


def _monitor_path(monitor_id: str) -> str:
    return "/steer/monitors/" + quote(monitor_id, safe="").replace(".", "%2E")


def _served_model(response: httpx.Response) -> str:
    models = response.json().get("data") or []
    if not models:
        raise ValueError("the server's GET /v1/models lists no model: pass model=")
    return str(models[0]["id"])


def _with_timeout(args: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    return args if timeout is None else {**args, "timeout": timeout}


def _vector_path(vector_id: str) -> str:
    segment = quote(vector_id, safe="")
    if vector_id in (".", ".."):  # valid ids, but URL dot-segments that clients would collapse
        segment = segment.replace(".", "%2E")
    return f"/steer/vectors/{segment}"


def _checked(response: httpx.Response) -> httpx.Response:
    if response.is_success:
        return response
    try:
        error = response.json()["error"]
        code, message, field = str(error["code"]), str(error["message"]), error.get("field")
    except (ValueError, KeyError, TypeError):
        code, message, field = "http_error", response.text[:500] or response.reason_phrase, None
    raise HotwireError(response.status_code, code, message, field)


def _deleted(vector_id: str, response: httpx.Response) -> DeleteResult:
    if response.status_code == 204:
        return DeleteResult(id=vector_id, in_flight=0)
    return DeleteResult.model_validate(response.json())


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _completion_headers(own_key: str | None, vllm_key: str | None) -> dict[str, str]:
    """A completion's headers: vLLM's key where it is not the client's, which then goes in ``X-Hotwire-Key`` (a
    server with a keys file wants a steered request's hotwire key there)."""
    if vllm_key is None or vllm_key == own_key:
        return _headers(own_key)
    return {**_headers(vllm_key), **({KEY_HEADER: own_key} if own_key else {})}


class HotwireClient:
    """Synchronous client. ``http_client`` replaces the internal ``httpx.Client`` (it is then not closed here)."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        http_client: httpx.Client | None = None,
    ):
        self.url = url.rstrip("/")
        self._key, self._headers = api_key, _headers(api_key)
        self._owned = http_client is None
        self._http = http_client or httpx.Client(timeout=timeout, limits=_LIMITS)
        self._model: str | None = None  # the server's, for complete

    def _send(self, call: _Call) -> httpx.Response:
        return _checked(self._http.request(**call.request_args(self.url, self._headers)))

    def register(
        self, vector_id: str, source: VectorSource, layers: Sequence[int] | None = None, replace: bool = False
    ) -> VectorMeta:
        """Register ``source`` (a .safetensors/.gguf/.json path, numpy array or torch tensor) as ``vector_id``."""
        return VectorMeta.model_validate(self._send(_register_call(vector_id, source, layers, replace)).json())

    def register_sae(
        self, vector_id: str, folder: str | os.PathLike, feature: int, replace: bool = False
    ) -> VectorMeta:
        """Register feature ``feature`` of the SAE in ``folder`` (SAELens: cfg.json, sae_weights.safetensors):
        its decoder row, at the layer its hook point follows."""
        return VectorMeta.model_validate(self._send(_sae_call(vector_id, folder, feature, replace)).json())

    def export(self, vector_id: str, file_format: str = "safetensors", version: int | None = None) -> bytes:
        """The vector as a file: ``safetensors`` (registers again unchanged) or ``gguf`` (llama.cpp, repeng)."""
        return self._send(_file_call(vector_id, file_format, version)).content

    def extract(self, vector_id: str, positive: Sequence[Any], negative: Sequence[Any], layers: Any = "all",
                method: str = "mean_diff", position: str = "last", normalize: bool = False, replace: bool = False,
                timeout: float | None = None) -> ExtractResult:
        """Compute a vector from contrastive examples (prompt strings or chat message lists) on the server and
        register it as ``vector_id``; ``layers``: "all", "8-20", a range or a list. ``timeout``: seconds for this
        call (an extraction of many examples outlasts the client's default)."""
        call = _extract_call(vector_id, positive, negative, layers, method, position, normalize, replace)
        response = _checked(self._http.request(**_with_timeout(call.request_args(self.url, self._headers), timeout)))
        return ExtractResult.model_validate(response.json())

    def list(self) -> list[VectorMeta]:
        return VectorList.model_validate(self._send(_Call("GET", "/steer/vectors")).json()).vectors

    def get(self, vector_id: str) -> VectorMeta:
        return VectorMeta.model_validate(self._send(_Call("GET", _vector_path(vector_id))).json())

    def delete(self, vector_id: str) -> DeleteResult:
        """Delete a vector; ``in_flight > 0`` means running requests keep it until they finish."""
        return _deleted(vector_id, self._send(_Call("DELETE", _vector_path(vector_id))))

    def slots(self, max_age_ms: int = 0) -> SlotStats:
        """The slot bank; ``max_age_ms`` > 0 accepts the server's cached numbers up to that age (cheap to poll)."""
        return SlotStats.model_validate(self._send(_slots_call(max_age_ms)).json())

    def fleet(self) -> FleetView:
        """Every replica on the server's registry (one, ``local``, without ``HOTWIRE_REGISTRY``)."""
        return FleetView.model_validate(self._send(_Call("GET", "/steer/fleet")).json())

    def monitors(self) -> list[Monitor]:
        return MonitorList.model_validate(self._send(_Call("GET", "/steer/monitors")).json()).monitors

    def add_monitor(self, monitor: Monitor | dict[str, Any], replace: bool = False) -> list[Monitor]:
        """Read ``monitor``'s probe on every chat and completions request (see docs/usage.md, "Monitors")."""
        return MonitorList.model_validate(self._send(_monitor_call(monitor, replace)).json()).monitors

    def delete_monitor(self, monitor_id: str) -> None:
        self._send(_Call("DELETE", _monitor_path(monitor_id)))

    def complete(self, prompt: str | Sequence[int], max_tokens: int = 16, *, steer: Steering | None = None,
                 read: Sequence[dict[str, Any]] | None = None, tokens: str = "generated", model: str | None = None,
                 api_key: str | None = None, **params: Any) -> Completion:
        """One completion (``POST /v1/completions``), steered by ``steer`` (a spec: JSON string, entry or list of
        entries) and reading ``read`` (probes ``{"id", "layer"[, "bias"]}``) on ``tokens`` (generated, prompt or
        all). ``model``: default the server's first; ``api_key``: vLLM's key where it is not the client's (whose
        key then goes in ``X-Hotwire-Key``); ``params``: other fields of the body (``temperature``, ``seed``, ...)."""
        body = completion_body(model, prompt, max_tokens, steer, read, tokens, params)  # checked before sending
        headers = _completion_headers(self._key, api_key)
        if model is None:
            self._model = self._model or _served_model(_checked(self._http.get(f"{self.url}/v1/models",
                                                                               headers=headers)))
            body["model"] = self._model
        return completion_of(_checked(self._http.post(f"{self.url}/v1/completions", json=body, headers=headers)))

    def close(self) -> None:
        if self._owned:
            self._http.close()

    def __enter__(self) -> HotwireClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncHotwireClient:
    """Asynchronous client; same methods as :class:`HotwireClient`, awaited."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        http_client: httpx.AsyncClient | None = None,
    ):
        self.url = url.rstrip("/")
        self._key, self._headers = api_key, _headers(api_key)
        self._owned = http_client is None
        self._http = http_client or httpx.AsyncClient(timeout=timeout, limits=_LIMITS)
        self._model: str | None = None  # the server's, for complete

    async def _send(self, call: _Call) -> httpx.Response:
        return _checked(await self._http.request(**call.request_args(self.url, self._headers)))

    async def register(
        self, vector_id: str, source: VectorSource, layers: Sequence[int] | None = None, replace: bool = False
    ) -> VectorMeta:
        """Register ``source`` (a .safetensors/.gguf/.json path, numpy array or torch tensor) as ``vector_id``."""
        response = await self._send(_register_call(vector_id, source, layers, replace))
        return VectorMeta.model_validate(response.json())

    async def register_sae(
        self, vector_id: str, folder: str | os.PathLike, feature: int, replace: bool = False
    ) -> VectorMeta:
        """Register feature ``feature`` of the SAE in ``folder`` (SAELens: cfg.json, sae_weights.safetensors)."""
        return VectorMeta.model_validate((await self._send(_sae_call(vector_id, folder, feature, replace))).json())

    async def export(self, vector_id: str, file_format: str = "safetensors", version: int | None = None) -> bytes:
        """The vector as a file: ``safetensors`` (registers again unchanged) or ``gguf`` (llama.cpp, repeng)."""
        return (await self._send(_file_call(vector_id, file_format, version))).content

    async def extract(self, vector_id: str, positive: Sequence[Any], negative: Sequence[Any], layers: Any = "all",
                      method: str = "mean_diff", position: str = "last", normalize: bool = False,
                      replace: bool = False, timeout: float | None = None) -> ExtractResult:
        """Compute a vector from contrastive examples on the server and register it (see ``HotwireClient.extract``)."""
        call = _extract_call(vector_id, positive, negative, layers, method, position, normalize, replace)
        args = _with_timeout(call.request_args(self.url, self._headers), timeout)
        return ExtractResult.model_validate(_checked(await self._http.request(**args)).json())

    async def list(self) -> list[VectorMeta]:
        return VectorList.model_validate((await self._send(_Call("GET", "/steer/vectors"))).json()).vectors

    async def get(self, vector_id: str) -> VectorMeta:
        return VectorMeta.model_validate((await self._send(_Call("GET", _vector_path(vector_id)))).json())

    async def delete(self, vector_id: str) -> DeleteResult:
        """Delete a vector; ``in_flight > 0`` means running requests keep it until they finish."""
        return _deleted(vector_id, await self._send(_Call("DELETE", _vector_path(vector_id))))

    async def slots(self, max_age_ms: int = 0) -> SlotStats:
        """The slot bank; ``max_age_ms`` > 0 accepts the server's cached numbers up to that age (cheap to poll)."""
        return SlotStats.model_validate((await self._send(_slots_call(max_age_ms))).json())

    async def fleet(self) -> FleetView:
        """Every replica on the server's registry (one, ``local``, without ``HOTWIRE_REGISTRY``)."""
        return FleetView.model_validate((await self._send(_Call("GET", "/steer/fleet"))).json())

    async def monitors(self) -> list[Monitor]:
        return MonitorList.model_validate((await self._send(_Call("GET", "/steer/monitors"))).json()).monitors

    async def add_monitor(self, monitor: Monitor | dict[str, Any], replace: bool = False) -> list[Monitor]:
        return MonitorList.model_validate((await self._send(_monitor_call(monitor, replace))).json()).monitors

    async def delete_monitor(self, monitor_id: str) -> None:
        await self._send(_Call("DELETE", _monitor_path(monitor_id)))

    async def complete(self, prompt: str | Sequence[int], max_tokens: int = 16, *, steer: Steering | None = None,
                       read: Sequence[dict[str, Any]] | None = None, tokens: str = "generated",
                       model: str | None = None, api_key: str | None = None, **params: Any) -> Completion:
        body = completion_body(model, prompt, max_tokens, steer, read, tokens, params)
        headers = _completion_headers(self._key, api_key)
        if model is None:
            self._model = self._model or _served_model(
                _checked(await self._http.get(f"{self.url}/v1/models", headers=headers)))
            body["model"] = self._model
        return completion_of(_checked(await self._http.post(f"{self.url}/v1/completions", json=body, headers=headers)))

    async def aclose(self) -> None:
        if self._owned:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncHotwireClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
