"""hotwire_core.extraction (the arithmetic of vectors from contrastive examples) and the engine core's admission of
capture requests (hotwire_core.capture_admission), on real ``vllm.v1.request.Request`` objects."""

from __future__ import annotations

import numpy as np
import pytest
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from hotwire_core.admission import ModelInfo, Refusal, Rules
from hotwire_core.capture_admission import CaptureRequests, capture_args
from hotwire_core.contract import CAPTURE_KEY
from hotwire_core.extraction import (
    ExtractionError, check_sets, extract, layer_list, mean_diff, means_from_captures, pca_diff, separation,
)
from hotwire_core.spec import SALT_PREFIX
from hotwire_core.vllm_glue.requests import VLLM_REQUESTS

H = 16


def test_mean_diff_is_the_difference_of_the_means():
    pos = np.array([[1.0, 2.0], [3.0, 4.0]])
    neg = np.array([[0.0, 1.0], [0.0, 3.0], [0.0, 5.0]])
    assert mean_diff(pos, neg).tolist() == [2.0, 0.0]


def test_pca_diff_finds_the_direction_the_pairs_differ_along_with_positives_higher():
    rng = np.random.default_rng(0)
    u = rng.normal(size=H)
    u /= np.linalg.norm(u)
    neg = rng.normal(size=(12, H))
    amounts = np.array([3.0, 1.0, 4.0, 1.5, 5.0, 2.0, 6.0, 2.5, 3.5, 0.5, 4.5, -1.0])  # 11 of 12 pairs higher
    pos = neg + amounts[:, None] * u + 1e-3 * rng.normal(size=(12, H))
    v = pca_diff(pos, neg)
    assert np.linalg.norm(v) == pytest.approx(1.0)
    assert v @ u > 0.999  # the component, with the sign that makes most positives project higher
    assert np.allclose(pca_diff(neg, pos), -v)  # swapped sets: the sign follows the majority


def test_pca_diff_is_the_centred_first_principal_component():
    """What repeng's pca_diff takes from scikit-learn's PCA(n_components=1): the top right singular vector of the
    differences minus their mean (not of the raw differences)."""
    rng = np.random.default_rng(1)
    diffs = rng.normal(size=(8, H)) + 10 * rng.normal(size=H)  # a large common offset PCA must ignore
    neg = rng.normal(size=(8, H))
    v = pca_diff(neg + diffs, neg)
    centred = diffs - diffs.mean(0)
    top = np.linalg.eigh(centred.T @ centred)[1][:, -1]
    assert abs(v @ top) == pytest.approx(1.0)
    offset = diffs.mean(0) / np.linalg.norm(diffs.mean(0))
    assert abs(v @ offset) < 0.9


def test_separation_is_the_gap_in_pooled_standard_deviations():
    unit = np.eye(H)[0]
    pos = np.zeros((2, H)); pos[:, 0] = [3.0, 5.0]  # mean 4, var 1
    neg = np.zeros((2, H)); neg[:, 0] = [-1.0, 1.0]  # mean 0, var 1
    got = separation(pos, neg, 2.0 * unit)
    assert got == {"separation": 4.0, "gap": 4.0, "accuracy": 1.0, "norm": 2.0}
    neg[:, 0] = [3.5, 3.5]  # mid 3.75: one positive on the wrong side
    assert separation(pos, neg, unit)["accuracy"] == 0.75
    same = separation(np.ones((1, H)), np.zeros((1, H)), unit)
    assert same["separation"] is None and same["gap"] == 1.0  # no spread: no number pretends to measure it


def test_extract_per_layer_and_normalize():
    rng = np.random.default_rng(2)
    pos, neg = rng.normal(size=(3, 2, H)) + 1.0, rng.normal(size=(3, 2, H))
    vectors, report = extract(pos, neg, [5, 7], "mean_diff")
    assert np.allclose(vectors[1], pos[:, 1].mean(0) - neg[:, 1].mean(0))
    assert [r["layer"] for r in report] == [5, 7]
    unit, _ = extract(pos, neg, [5, 7], "mean_diff", normalize=True)
    assert np.allclose(np.linalg.norm(unit, axis=1), 1.0)
    assert np.allclose(unit[0], vectors[0] / np.linalg.norm(vectors[0]))


@pytest.mark.parametrize("n_pos, n_neg, method, code", [
    (0, 2, "mean_diff", "empty_examples"),
    (2, 0, "pca", "empty_examples"),
    (3, 2, "pca", "unpaired_examples"),
    (1, 1, "pca", "unpaired_examples"),
    (2, 2, "lda", "bad_method"),
])
def test_what_cannot_be_extracted_is_refused_with_400(n_pos, n_neg, method, code):
    with pytest.raises(ExtractionError) as info:
        check_sets(n_pos, n_neg, method)
    assert (info.value.status, info.value.code) == (400, code)
    check_sets(3, 2, "mean_diff")  # unpaired sets are fine for mean_diff


def test_layer_list():
    hooked = range(4)
    assert layer_list(None, hooked) == [0, 1, 2, 3] == layer_list("all", hooked)
    assert layer_list("1-2", hooked) == [1, 2]
    assert layer_list(range(2, 4), hooked) == [2, 3]
    assert layer_list([3, np.int64(1), 3], hooked) == [1, 3]
    for bad, code in (([4], "layer_out_of_range"), ("x", "bad_layers"), ([True], "bad_layers"), ([], "bad_layers")):
        with pytest.raises(ExtractionError) as info:
            layer_list(bad, hooked)
        assert (info.value.status, info.value.code) == (400, code)


def _capture(layers, rows, tokens=1):
    return {"layers": layers, "tokens": tokens, "data": np.asarray(rows, np.float32).tobytes()}


def test_captures_of_pipeline_and_tensor_parallel_ranks_are_merged_and_averaged():
    a0, a1, a2 = np.full(H, 2.0), np.full(H, 4.0), np.full(H, 6.0)
    answers = [
        {"ok": True, "captures": {"t": _capture([0, 1], [a0, a1], tokens=2)}},  # rank 0 of PP (and its TP twin)
        {"ok": True, "captures": {"t": _capture([0, 1], [a0, a1], tokens=2)}},
        {"ok": True, "captures": {"t": _capture([2], [a2], tokens=2)}},  # rank 1 of PP
    ]
    got = means_from_captures(answers, ["t"], [0, 2], H)
    assert got.shape == (1, 2, H) and got[0, 0, 0] == 1.0 and got[0, 1, 0] == 3.0
    with pytest.raises(ExtractionError, match="no worker captured layers \\[3\\]"):
        means_from_captures(answers, ["t"], [0, 3], H)
    with pytest.raises(ExtractionError, match="tag u"):
        means_from_captures(answers, ["u"], [0], H)
    with pytest.raises(ExtractionError, match="aborted") as info:
        means_from_captures([{"ok": True, "captures": {"t": {"error": "the request was aborted"}}}], ["t"], [0], H)
    assert info.value.code == "capture_failed"


# -- admission of capture requests in the engine core ----------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _none_hash():
    init_none_hash(sha256)


def rules(steerable=True) -> Rules:
    model = ModelInfo(steerable, "" if steerable else "no decoder layer", 4, H, "float32", frozenset({0, 1, 2}))
    return Rules(model, 2, 8, 8)


def request(rid="r", extra=None, salt=None) -> Request:
    params = SamplingParams(max_tokens=1, extra_args=extra)
    return Request(rid, list(range(100, 140)), params, None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(16, sha256))


def refusal(captures: CaptureRequests, req: Request, r: Rules | None = None) -> tuple[int, str]:
    with pytest.raises(Refusal) as info:
        captures.admit(req, r or rules())
    return info.value.status, info.value.code


def test_a_capture_request_gets_a_cache_salt_of_its_own_and_counts_until_released():
    captures = CaptureRequests(2, VLLM_REQUESTS)
    plain = request("p")
    a, b = request("a", capture_args("ta", [2, 0, 2], "mean")), request("b", capture_args("tb", [1], "last"))
    captures.admit(a, rules())
    captures.admit(b, rules())
    assert a.cache_salt.startswith(SALT_PREFIX) and a.cache_salt != b.cache_salt
    assert a.block_hashes and a.block_hashes[0] != plain.block_hashes[0]  # hashed again with the salt
    assert a.sampling_params.extra_args[CAPTURE_KEY] == {"tag": "ta", "layers": [0, 2], "position": "mean"}
    assert refusal(captures, request("c", capture_args("tc", [1], "last"))) == (429, "capture_busy")
    captures.release("a")
    captures.admit(request("c", capture_args("tc", [1], "last")), rules())


@pytest.mark.parametrize("extra, expected", [
    ({**capture_args("t", [3], "last")}, (400, "layer_out_of_range")),  # layer 3 is not hooked
    ({**capture_args("t", [1], "max")}, (400, "bad_capture")),
    ({**capture_args("bad tag", [1], "last")}, (400, "bad_capture")),
    ({CAPTURE_KEY: {"tag": "t", "layers": [], "position": "last"}}, (400, "bad_capture")),
    ({CAPTURE_KEY: {"tag": "t", "layers": [1], "position": "last", "x": 1}}, (400, "bad_capture")),
    ({**capture_args("t", [1], "last"), "hotwire": '{"id": "v", "layer": 1, "scale": 1}'}, (400, "capture_with_steering")),
])
def test_bad_captures_are_refused(extra, expected):
    assert refusal(CaptureRequests(2, VLLM_REQUESTS), request("r", extra)) == expected


def test_capture_off_or_unsteerable_model_is_503():
    req = request("r", capture_args("t", [1], "last"))
    assert refusal(CaptureRequests(0, VLLM_REQUESTS), req) == (503, "capture_off")
    assert refusal(CaptureRequests(2, VLLM_REQUESTS), req, rules(steerable=False)) == (503, "model_not_steerable")


def test_the_controller_admits_captures_counts_them_and_frees_them_with_the_request():
    from hotwire_core.controller import SteeringController
    from hotwire_core.settings import Settings

    model = ModelInfo(True, "", 4, H, "float32", frozenset({0, 1, 2}), capture_rows=1)
    c = SteeringController(model, Settings(8, 2, "op", "off", None), "org/model", VLLM_REQUESTS)
    first = request("a", capture_args("ta", [1], "mean"))
    assert c.admit(first) is None  # no steering binding
    assert c.stats()["capturing"] == 1 and first.cache_salt.startswith(SALT_PREFIX)
    with pytest.raises(Refusal) as info:
        c.admit(request("b", capture_args("tb", [1], "mean")))
    assert info.value.code == "capture_busy" and c.stats()["refused"] == {"capture_busy": 1}
    c.release("a")  # vLLM freed it: finished or aborted
    assert c.stats()["capturing"] == 0
    c.admit(request("b", capture_args("tb", [1], "mean")))
