"""What a model name means and the error body (serve_deployments/openai_api.py): the one definition the
ingress and the replica share. Pure: no Ray, no engine."""
from __future__ import annotations

import pytest

from serve_deployments.openai_api import (
    ModelNameError,
    base_id,
    error_body,
    openai_type,
    resolve_model,
    resolve_version,
    served_name,
    served_names,
)

MODEL = "/srv/models/tiny-model/"


def status_of(fn, *args) -> int:
    with pytest.raises(ModelNameError) as e:
        fn(*args)
    return e.value.status


def test_base_names_mean_the_base_weights_version():
    assert base_id(MODEL) == "tiny-model"
    for name in (None, "", "base", "tiny-model"):
        assert resolve_model(name, [3, 4], 0, MODEL) == 0
        assert resolve_model(name, [3, 4], 4, MODEL) == 4  # merge mode: the base weights are policy-v4's
    assert served_name(0) == "base" and served_name(4) == "policy-v4"


def test_policy_names():
    live = [3, 4]
    assert resolve_model("policy-latest", live, 0, MODEL) == 4  # the newest live version
    assert resolve_model("policy-v3", live, 0, MODEL) == 3
    assert status_of(resolve_model, "policy-latest", [], 0, MODEL) == 404
    assert status_of(resolve_model, "policy-v5", live, 0, MODEL) == 404  # not live (held or not)
    assert status_of(resolve_model, "policy-v0", live, 0, MODEL) == 404  # the base model has no policy name
    assert resolve_model("policy-v4", live, 4, MODEL) == 4  # merge mode: the merged version is live
    with pytest.raises(ModelNameError, match="serving: tiny-model, base, policy-v3, policy-v4, policy-latest"):
        resolve_model("gpt-17", live, 0, MODEL)
    assert served_names([], "/m/base") == ["base"]


def test_malformed_and_path_like_names_are_400_and_never_echoed():
    for name in ("../../etc/passwd", "/srv/models/tiny-model", MODEL, "policy-latest/../../x", "a\x00b", "x" * 200,
                 "-leading-dash"):
        with pytest.raises(ModelNameError) as e:
            resolve_model(name, [1], 0, MODEL)
        assert e.value.status == 400 and name not in e.value.message
    assert status_of(resolve_model, 7, [1], 0, MODEL) == 400
    assert status_of(resolve_model, ["policy-v1"], [1], 0, MODEL) == 400


def test_handle_versions():
    assert resolve_version(None, [2, 5], 0) == 5
    assert resolve_version(None, [], 0) == 0 and resolve_version(None, [], 3) == 3
    assert resolve_version(2, [2, 5], 0) == 2 and resolve_version(0, [2], 0) == 0
    assert status_of(resolve_version, 9, [2, 5], 0) == 404
    assert status_of(resolve_version, 0, [2, 5], 2) == 404  # merged: the original base is gone


def test_error_body():
    assert error_body(404, "nope") == {"error": {"message": "nope", "type": "not_found_error", "param": None,
                                                 "code": 404}}
    assert error_body(400, "bad", param="n")["error"]["type"] == "invalid_request_error"
    assert error_body(503, "down", "server_error")["error"]["type"] == "server_error"
    assert [openai_type(s) for s in (401, 403, 413, 429, 500)] == [
        "authentication_error", "permission_error", "invalid_request_error", "rate_limit_error", "server_error"]
