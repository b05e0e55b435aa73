"""Wire types (protocol.py), the pre-receive checks of a weight update
(``contracts.validate_update_request``) and ``TokenBatch`` validation."""

from __future__ import annotations

import string
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pipelinerl_sdk.contracts import TokenBatch, validate_update_request
from pipelinerl_sdk.errors import UpdateRejected
from pipelinerl_sdk.protocol import (
    DTYPE_SIZES,
    ChatCompletionRequest,
    GroupState,
    InitProcessGroupRequest,
    ParamSpec,
    ProbeBroadcastRequest,
    ReceiveMode,
    WeightUpdateRequest,
    parse_init_method,
)
from pipelinerl_sdk.weights.buckets import BucketPlan

DTYPES: list[str] = sorted(DTYPE_SIZES)


def spec(name: str, dtype: str, shape: tuple[int, ...]) -> ParamSpec:
    return ParamSpec(name=name, dtype=dtype, shape=shape)  # type: ignore[arg-type]


def error_locs(exc: ValidationError) -> list[tuple[str | int, ...]]:
    return [tuple(e["loc"]) for e in exc.errors()]


# --- parse_init_method ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("init_method", "host", "port"),
    [
        ("tcp://127.0.0.1:29500", "127.0.0.1", 29500),
        ("tcp://localhost:1", "localhost", 1),
        ("tcp://[::1]:8000", "::1", 8000),
        ("tcp://trainer-0.svc.cluster.local:65535", "trainer-0.svc.cluster.local", 65535),
    ],
)
def test_parse_init_method_accepts(init_method: str, host: str, port: int) -> None:
    assert parse_init_method(init_method) == (host, port)


@pytest.mark.parametrize(
    ("init_method", "message"),
    [
        ("127.0.0.1:29500", "must look like tcp://HOST:PORT"),
        ("//127.0.0.1:29500", "must look like tcp://HOST:PORT"),
        ("env://", "must look like tcp://HOST:PORT"),
        ("http://127.0.0.1:29500", "must look like tcp://HOST:PORT"),
        ("tcp://127.0.0.1:0", "port out of range: 0"),
        ("tcp://127.0.0.1:70000", "port out of range: 70000"),
        ("tcp://127.0.0.1:123456", "must look like tcp://HOST:PORT"),
        ("tcp://127.0.0.1", "must look like tcp://HOST:PORT"),
        ("tcp://:29500", "must look like tcp://HOST:PORT"),
        ("tcp://127.0.0.1: 29500", "must look like tcp://HOST:PORT"),
        ("tcp://my host:29500", "must look like tcp://HOST:PORT"),
        (" tcp://127.0.0.1:29500", "must look like tcp://HOST:PORT"),
        ("tcp://127.0.0.1:29500 ", "must look like tcp://HOST:PORT"),
        ("tcp://127.0.0.1:29500\n", "must look like tcp://HOST:PORT"),
        ("tcp://127.0.0.1:\u0662\u0669\u0665\u0660\u0660", "must look like tcp://HOST:PORT"),  # Arabic-Indic digits
        ("tcp://[::1:8000", "must look like tcp://HOST:PORT"),
        ("", "must look like tcp://HOST:PORT"),
    ],
)
def test_parse_init_method_rejects(init_method: str, message: str) -> None:
    with pytest.raises(ValueError, match="init_method") as info:
        parse_init_method(init_method)
    assert message in str(info.value)


UNICODE_DIGITS = [str.maketrans("0123456789", "".join(chr(base + i) for i in range(10))) for base in (0x660, 0xFF10)]


@st.composite
def near_valid_init_methods(draw: st.DrawFn) -> str:
    """A valid ``tcp://HOST:PORT`` with one small defect or none: surrounding whitespace, non-ASCII
    digits in the port, leading zeros."""
    host = draw(st.sampled_from(["127.0.0.1", "localhost", "[::1]", "trainer-0.svc", "h"]))
    port = str(draw(st.integers(0, 99999)))
    defect = draw(st.sampled_from(["none", "prefix", "suffix", "digits", "zeros"]))
    if defect == "digits":
        port = port.translate(draw(st.sampled_from(UNICODE_DIGITS)))
    elif defect == "zeros":
        port = "0" + port
    text = f"tcp://{host}:{port}"
    space = draw(st.sampled_from([" ", "\n", "\t", "\r\n", "\u00a0"]))
    if defect == "prefix":
        text = space + text
    elif defect == "suffix":
        text = text + space
    return text


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        near_valid_init_methods(),
        st.text(),
        st.builds(lambda s: "tcp://" + s, st.text()),
        st.builds(
            lambda h, p: f"tcp://{h}:{p}",
            st.text(alphabet=string.ascii_letters + string.digits + ".-[]: \n\t", max_size=12),
            st.text(alphabet=string.digits + " \n+-_", max_size=7),
        ),
    )
)
def test_parse_init_method_total(text: str) -> None:
    """Any text: a ValueError, or a (host, port) that is exactly what the text says."""
    try:
        host, port = parse_init_method(text)
    except ValueError as e:
        assert "init_method" in str(e)
        return
    assert text.isascii()
    assert not any(c.isspace() for c in text)
    assert text.startswith("tcp://")
    rest, _, port_text = text[len("tcp://") :].rpartition(":")
    assert port_text.isdigit() and int(port_text) == port
    assert 0 < port < 65536
    assert rest.strip("[]") == host and host


# --- pydantic models ------------------------------------------------------------------------------


def good_update(**overrides: Any) -> dict[str, Any]:
    params = [{"name": "w", "dtype": "float32", "shape": [2, 3]}, {"name": "b", "dtype": "float32", "shape": [3]}]
    body: dict[str, Any] = {
        "version": 1,
        "params": params,
        "bucket_bytes": 1024,
        "plan_digest": "0" * 64,
        "group_id": "ab" * 16,
    }
    body.update(overrides)
    return body


def good_init(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "init_method": "tcp://127.0.0.1:29500",
        "rank_offset": 1,
        "world_size": 2,
        "group_secret": "5e" * 32,
    }
    body.update(overrides)
    return body


@pytest.mark.parametrize(
    ("model", "body", "loc"),
    [
        (WeightUpdateRequest, good_update(bogus=1), ("bogus",)),
        (InitProcessGroupRequest, good_init(secret="x"), ("secret",)),
        (ProbeBroadcastRequest, {"nbytes": 1, "probe_id": 0, "group_id": "ab", "extra_field": True}, ("extra_field",)),
        (ParamSpec, {"name": "w", "dtype": "float32", "shape": [1], "device": "cuda"}, ("device",)),
        (
            WeightUpdateRequest,
            good_update(params=[{"name": "w", "dtype": "float32", "shape": [1], "stride": [1]}]),
            ("params", 0, "stride"),
        ),
    ],
)
def test_models_refuse_unknown_fields(model: type[Any], body: dict[str, Any], loc: tuple[str | int, ...]) -> None:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    errors = info.value.errors()
    assert [(tuple(e["loc"]), e["type"]) for e in errors] == [(loc, "extra_forbidden")]
    assert str(loc[-1]) in str(info.value)


def test_chat_request_ignores_unknown_fields_as_vllm() -> None:
    """Clients built against vLLM send fields we do not know: ignored, like vLLM; the known
    vLLM fields parse with its types (stop as str or list, logit_bias keys as ids)."""
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "frequency_penaltyy": 0.1,
            "stop": "x",
            "logit_bias": {"5": 3.0},
            "logprobs": 1,
            "prompt_logprobs": 2,
        }
    )
    assert req.stop_strings == ("x",) and req.logit_bias == {5: 3.0} and req.logprobs is True
    assert req.prompt_top == 2 and req.messages[0].for_template() == {"role": "user", "content": "a\nb"}
    assert "frequency_penaltyy" not in req.model_dump()
    plain = {"messages": [{"role": "user", "content": "a"}]}
    assert ChatCompletionRequest.model_validate({**plain, "stop": ["x", ""]}).stop_strings == ("x",)
    assert ChatCompletionRequest.model_validate({**plain, "prompt_logprobs": True}).prompt_top == 0
    assert ChatCompletionRequest.model_validate(plain).prompt_top is None
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({**plain, "presence_penalty": 3})
    assert info.value.errors()[0]["loc"] == ("presence_penalty",)


def test_good_bodies_validate() -> None:
    req = WeightUpdateRequest.model_validate(good_update())
    assert [p.name for p in req.params] == ["w", "b"]
    assert req.params[0].shape == (2, 3)
    assert req.params[0].nbytes == 24
    assert req.mode is None
    assert req.timeout_s == 120.0
    init = InitProcessGroupRequest.model_validate(good_init())
    assert (init.backend, init.group_name, init.timeout_s) == ("gloo", "pipelinerl-weights", 120.0)


def test_wire_models_are_frozen() -> None:
    req = WeightUpdateRequest.model_validate(good_update())
    with pytest.raises(ValidationError, match="frozen"):
        req.version = 2


def test_param_spec_sizes() -> None:
    assert spec("s", "float64", ()).numel == 1
    assert spec("s", "float64", ()).nbytes == 8
    assert spec("z", "bfloat16", (3, 0, 5)).nbytes == 0
    assert spec("m", "int16", (4, 5)).nbytes == 40
    with pytest.raises(ValidationError) as info:
        ParamSpec.model_validate({"name": "x", "dtype": "float8", "shape": [1]})
    assert error_locs(info.value) == [("dtype",)]
    with pytest.raises(ValidationError) as info:
        ParamSpec.model_validate({"name": "x", "dtype": "float32", "shape": [2, -1]})
    assert error_locs(info.value) == [("shape", 1)]
    with pytest.raises(ValidationError) as info:
        ParamSpec.model_validate({"name": "", "dtype": "float32", "shape": [1]})
    assert error_locs(info.value) == [("name",)]


def test_update_request_refuses_duplicate_names() -> None:
    params = [{"name": "w", "dtype": "float32", "shape": [1]}, {"name": "w", "dtype": "float32", "shape": [1]}]
    with pytest.raises(ValidationError, match=r"params: duplicate name 'w'"):
        WeightUpdateRequest.model_validate(good_update(params=params))


@pytest.mark.parametrize(
    ("overrides", "loc"),
    [
        ({"version": 0}, ("version",)),
        ({"version": -3}, ("version",)),
        ({"version": 2**64 + 7}, ("version",)),
        ({"version": 2**53}, ("version",)),
        ({"group_id": ""}, ("group_id",)),
        ({"params": []}, ("params",)),
        ({"bucket_bytes": 1023}, ("bucket_bytes",)),
        ({"bucket_bytes": (1 << 34) + 1}, ("bucket_bytes",)),
        ({"plan_digest": "abc"}, ("plan_digest",)),
        ({"mode": "eager"}, ("mode",)),
        ({"timeout_s": 0}, ("timeout_s",)),
    ],
)
def test_update_request_field_limits(overrides: dict[str, Any], loc: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError) as info:
        WeightUpdateRequest.model_validate(good_update(**overrides))
    assert error_locs(info.value) == [loc]


@pytest.mark.parametrize(
    ("overrides", "loc", "message"),
    [
        ({"rank_offset": 0}, ("rank_offset",), "greater than or equal to 1"),
        ({"world_size": 1}, ("world_size",), "greater than or equal to 2"),
        ({"group_name": "has space"}, ("group_name",), "should match pattern"),
        ({"group_name": "a/b"}, ("group_name",), "should match pattern"),
        ({"group_name": ""}, ("group_name",), "at least 1 character"),
        ({"backend": "mpi"}, ("backend",), "'gloo' or 'nccl'"),
        ({"init_method": "127.0.0.1:29500"}, ("init_method",), "init_method must look like tcp://HOST:PORT"),
        ({"init_method": "tcp://127.0.0.1:0"}, ("init_method",), "init_method port out of range: 0"),
        ({"timeout_s": 3601}, ("timeout_s",), "less than or equal to 3600"),
        ({"group_secret": "5e" * 8}, ("group_secret",), "at least 32 characters"),
        ({"group_secret": "Z" * 64}, ("group_secret",), "should match pattern"),
    ],
)
def test_init_request_refusals(overrides: dict[str, Any], loc: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        InitProcessGroupRequest.model_validate(good_init(**overrides))
    assert error_locs(info.value) == [loc]
    assert message in str(info.value)


# --- validate_update_request ----------------------------------------------------------------------

EXPECTED = [
    spec("model.embed_tokens.weight", "float32", (32, 8)),
    spec("model.layers.0.mlp.up_proj.weight", "bfloat16", (16, 8)),
    spec("model.norm.weight", "float32", (8,)),
    spec("lm_head.bias", "float32", ()),
]
MODES: frozenset[ReceiveMode] = frozenset({"direct", "staged"})
HEALTHY = GroupState(group_name="g", group_id="ab" * 16, ranks=[1], world_size=2, backend="gloo", broken=False)
BROKEN = GroupState(
    group_name="g", group_id="ab" * 16, ranks=[1], world_size=2, backend="gloo", broken=True, reason="peer lost"
)
CURRENT = 3


def update_body(params: list[ParamSpec], *, version: int = CURRENT + 1, bucket_bytes: int = 1024) -> dict[str, Any]:
    return {
        "version": version,
        "params": [p.model_dump() for p in params],
        "bucket_bytes": bucket_bytes,
        "plan_digest": BucketPlan.build(params, bucket_bytes).digest(),
        "group_id": "ab" * 16,
    }


def check(
    body: dict[str, Any],
    *,
    group: GroupState | None = HEALTHY,
    modes: frozenset[ReceiveMode] = MODES,
    expected: list[ParamSpec] = EXPECTED,
    current: int = CURRENT,
) -> None:
    validate_update_request(
        WeightUpdateRequest.model_validate(body),
        expected=expected,
        current_version=current,
        modes=modes,
        group=group,
    )


def test_valid_update_passes() -> None:
    check(update_body(EXPECTED))
    check({**update_body(EXPECTED), "mode": "staged"})
    check({**update_body(EXPECTED, version=CURRENT + 100), "mode": None})
    # Order is the sender's choice, as long as the digest is of that order.
    check(update_body(list(reversed(EXPECTED)), bucket_bytes=4096))


def renamed(i: int, name: str) -> list[ParamSpec]:
    out = list(EXPECTED)
    out[i] = spec(name, out[i].dtype, out[i].shape)
    return out


def reshaped(i: int, shape: tuple[int, ...]) -> list[ParamSpec]:
    out = list(EXPECTED)
    out[i] = spec(out[i].name, out[i].dtype, shape)
    return out


def retyped(i: int, dtype: str) -> list[ParamSpec]:
    out = list(EXPECTED)
    out[i] = spec(out[i].name, dtype, out[i].shape)
    return out


@pytest.mark.parametrize(
    ("body", "kwargs", "status", "field", "message"),
    [
        pytest.param(update_body(EXPECTED), {"group": None}, 409, "group", "call /init_process_group", id="no-group"),
        pytest.param(update_body(EXPECTED), {"group": BROKEN}, 409, "group", "broken (peer lost)", id="broken"),
        pytest.param(
            {**update_body(EXPECTED), "group_id": "cd" * 16},
            {},
            409,
            "group_id",
            f"group_id {'cd' * 16!r} is not this server's current group ({'ab' * 16!r})",
            id="other-group",
        ),
        pytest.param(
            update_body(EXPECTED, version=CURRENT), {}, 409, "version", "got 3, serving 3", id="version-equal"
        ),
        pytest.param(update_body(EXPECTED, version=1), {}, 409, "version", "got 1, serving 3", id="version-lower"),
        pytest.param(
            {**update_body(EXPECTED), "mode": "staged"},
            {"modes": frozenset({"direct"})},
            422,
            "mode",
            "mode 'staged' not supported (supported: ['direct'])",
            id="mode",
        ),
        pytest.param(update_body(renamed(2, "model.nrom.weight")), {}, 422, "params[2].name", "'model.nrom.weight'"),
        pytest.param(
            update_body(reshaped(1, (8, 16))), {}, 422, "params[1].shape", "shape [8, 16] != expected [16, 8]"
        ),
        pytest.param(update_body(reshaped(3, (1,))), {}, 422, "params[3].shape", "shape [1] != expected []"),
        pytest.param(update_body(retyped(0, "float16")), {}, 422, "params[0].dtype", "float16 != expected float32"),
        pytest.param(update_body(EXPECTED[:3]), {}, 422, "params", "missing 1, e.g. ['lm_head.bias']"),
        pytest.param(
            {**update_body(EXPECTED), "plan_digest": "f" * 64}, {}, 400, "plan_digest", "plan_digest", id="digest"
        ),
        pytest.param(
            {**update_body(EXPECTED), "plan_digest": update_body(EXPECTED, bucket_bytes=2048)["plan_digest"]},
            {},
            400,
            "plan_digest",
            "does not match",
            id="digest-of-other-bucket-size",
        ),
        pytest.param(
            {**update_body(list(reversed(EXPECTED))), "plan_digest": update_body(EXPECTED)["plan_digest"]},
            {},
            400,
            "plan_digest",
            "does not match",
            id="digest-of-other-order",
        ),
    ],
)
def test_update_rejections(body: dict[str, Any], kwargs: dict[str, Any], status: int, field: str, message: str) -> None:
    with pytest.raises(UpdateRejected) as info:
        check(body, **kwargs)
    assert (info.value.status, info.value.field) == (status, field)
    assert message in str(info.value)


def test_first_failing_check_wins() -> None:
    """Group before version before mode before params before digest."""
    bad = {**update_body(EXPECTED[:3], version=1), "mode": "staged", "plan_digest": "f" * 64}
    with pytest.raises(UpdateRejected) as info:
        check(bad, group=None, modes=frozenset({"direct"}))
    assert info.value.field == "group"
    with pytest.raises(UpdateRejected) as info:
        check(bad, modes=frozenset({"direct"}))
    assert info.value.field == "version"
    with pytest.raises(UpdateRejected) as info:
        check({**bad, "version": CURRENT + 1}, modes=frozenset({"direct"}))
    assert info.value.field == "mode"
    with pytest.raises(UpdateRejected) as info:
        check({**bad, "version": CURRENT + 1})
    assert info.value.field == "params"


# One valid request and any single mutation of it: accepted exactly when it is still valid.

MUTATIONS = (
    "version",
    "mode",
    "bucket_bytes",
    "plan_digest",
    "timeout_s",
    "extra_field",
    "drop",
    "duplicate",
    "add",
    "rename",
    "reshape",
    "retype",
    "swap",
)


@st.composite
def mutated_bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    order = draw(st.permutations(EXPECTED))
    bucket_bytes = draw(st.integers(1024, 1 << 16))
    body = update_body(list(order), version=draw(st.integers(CURRENT + 1, CURRENT + 5)), bucket_bytes=bucket_bytes)
    kind = draw(st.sampled_from(MUTATIONS))
    params: list[dict[str, Any]] = body["params"]
    i = draw(st.integers(0, len(params) - 1))
    if kind == "version":
        body["version"] = draw(st.integers(-2, CURRENT + 10))
    elif kind == "mode":
        body["mode"] = draw(st.sampled_from([None, "direct", "staged", "eager", 1]))
    elif kind == "bucket_bytes":
        body["bucket_bytes"] = draw(st.integers(0, 1 << 20))
    elif kind == "plan_digest":
        hexdigits = "0123456789abcdef"
        body["plan_digest"] = draw(
            st.one_of(st.text(alphabet=hexdigits, max_size=70), st.text(alphabet=hexdigits, min_size=64, max_size=64))
        )
    elif kind == "timeout_s":
        body["timeout_s"] = draw(st.floats(-10, 5000, allow_nan=False))
    elif kind == "extra_field":
        body[draw(st.sampled_from(["weights", "Version", "group"]))] = 1
    elif kind == "drop":
        del params[i]
    elif kind == "duplicate":
        params.insert(draw(st.integers(0, len(params))), dict(params[i]))
    elif kind == "add":
        params.insert(draw(st.integers(0, len(params))), {"name": "extra.weight", "dtype": "float32", "shape": [1]})
    elif kind == "rename":
        params[i] = {**params[i], "name": draw(st.sampled_from(["x", "model.norm.weight", "lm_head.bias", ""]))}
    elif kind == "reshape":
        params[i] = {**params[i], "shape": draw(st.lists(st.integers(-1, 40), max_size=3))}
    elif kind == "retype":
        params[i] = {**params[i], "dtype": draw(st.sampled_from([*DTYPES, "float8"]))}
    elif kind == "swap":
        j = draw(st.integers(0, len(params) - 1))
        params[i], params[j] = params[j], params[i]
    return kind, body


def semantically_valid(req: WeightUpdateRequest) -> bool:
    """What the contract requires, stated independently of the checks' order."""
    return (
        req.version > CURRENT
        and (req.mode is None or req.mode in MODES)
        and len(req.params) == len(EXPECTED)
        and set(req.params) == set(EXPECTED)
        and BucketPlan.build(req.params, req.bucket_bytes).digest() == req.plan_digest
    )


@settings(max_examples=300, deadline=None)
@given(mutated_bodies())
def test_any_single_mutation_is_accepted_iff_valid(case: tuple[str, dict[str, Any]]) -> None:
    kind, body = case
    try:
        req = WeightUpdateRequest.model_validate(body)
    except ValidationError as e:
        assert e.errors(), kind
        return
    try:
        validate_update_request(req, expected=EXPECTED, current_version=CURRENT, modes=MODES, group=HEALTHY)
    except UpdateRejected as e:
        assert e.status in (400, 409, 422), kind
        assert e.field is not None and str(e), kind
        assert not semantically_valid(req), f"{kind}: valid request rejected: {e}"
        return
    assert semantically_valid(req), f"{kind}: invalid request accepted: {body}"


# --- TokenBatch -------------------------------------------------------------------------------------


def test_token_batch_valid() -> None:
    batch = TokenBatch(
        input_ids=[[1, 2, 3], [4, 5]],
        completion_start=[1, 2],
        advantages=[0.5, -0.5],
        behaviour_logprobs=[[-0.1, -0.2], []],
    )
    assert len(batch) == 2
    assert len(TokenBatch(input_ids=[], completion_start=[])) == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_ids": [[1, 2], [3, 4]], "completion_start": [1]}, "completion_start: 1 entries for 2 sequences"),
        (
            {"input_ids": [[1, 2]], "completion_start": [1], "advantages": [0.1, 0.2]},
            "advantages: 2 entries for 1 sequences",
        ),
        (
            {"input_ids": [[1, 2]], "completion_start": [1], "behaviour_logprobs": [[0.0], [0.0]]},
            "behaviour_logprobs: 2 entries for 1 sequences",
        ),
        (
            {"input_ids": [[1, 2], [3]], "completion_start": [1, 1], "ref_logprobs": [[0.0]]},
            "ref_logprobs: 1 entries for 2 sequences",
        ),
        ({"input_ids": [[1, 2, 3]], "completion_start": [0]}, "completion_start[0]=0 outside 1..3"),
        ({"input_ids": [[1, 2], [1, 2, 3]], "completion_start": [1, 4]}, "completion_start[1]=4 outside 1..3"),
        ({"input_ids": [[]], "completion_start": [1]}, "completion_start[0]=1 outside 1..0"),
    ],
)
def test_token_batch_refusals(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        TokenBatch(**kwargs)
    assert str(info.value) == message


def test_min_tokens_is_refused_where_not_declared_or_past_the_budget() -> None:
    """The router's ``min_tokens`` rule: 0 passes everywhere; a non-zero value on a backend that
    does not declare it, or above the token budget (``max_completion_tokens`` first, as the
    budget is read), is an InvalidRequest naming ``min_tokens`` (a 400), never ignored."""
    from pipelinerl_sdk.errors import InvalidRequest
    from pipelinerl_sdk.http.server import check_min_tokens
    from pipelinerl_sdk.protocol import ChatCompletionRequest, CompletionRequest

    msgs: Any = [{"role": "user", "content": "x"}]
    check_min_tokens(ChatCompletionRequest(messages=msgs), False, "b")
    check_min_tokens(ChatCompletionRequest(messages=msgs, min_tokens=4, max_tokens=4), True, "b")
    check_min_tokens(ChatCompletionRequest(messages=msgs, min_tokens=9), True, "b")  # budget: the context
    refused = [
        (ChatCompletionRequest(messages=msgs, min_tokens=1), False),
        (CompletionRequest(prompt="x", min_tokens=2), False),
        (ChatCompletionRequest(messages=msgs, min_tokens=5, max_tokens=4), True),
        (ChatCompletionRequest(messages=msgs, min_tokens=5, max_tokens=9, max_completion_tokens=4), True),
        (CompletionRequest(prompt="x", min_tokens=17), True),  # completions' default budget is 16
    ]
    for req, declared in refused:
        with pytest.raises(InvalidRequest, match="min_tokens") as err:
            check_min_tokens(req, declared, "b")
        assert err.value.field == "min_tokens"
    with pytest.raises(ValidationError, match="min_tokens"):
        ChatCompletionRequest(messages=msgs, min_tokens=-1)
