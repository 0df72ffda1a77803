"""How calls are sent: retry policy, request ids, metadata, channel arguments."""

import json

from kvcached import channel
from kvcached.client import new_request_id, with_request_id
from kvcached.options import ClientOptions
from kvcached.proto import pb


def service_methods():
    return {method.name: method for method in
            pb.DESCRIPTOR.services_by_name["KvCacheService"].methods}


def test_retried_methods_exist_and_exclude_the_unsafe_ones():
    methods = service_methods()
    assert set(channel.RETRIED_METHODS) <= set(methods)
    for never in ("Update", "ImportSnapshot", "EvictSnapshots"):
        assert never not in channel.RETRIED_METHODS


def test_every_request_with_a_request_id_is_retried():
    for name, method in service_methods().items():
        if "request_id" in method.input_type.fields_by_name and name != "ImportSnapshot":
            assert name in channel.RETRIED_METHODS, name


def test_the_service_config_is_grpcs_retry_policy():
    config = json.loads(channel.retry_service_config())
    (method_config,) = config["methodConfig"]
    assert {name["method"] for name in method_config["name"]} == set(channel.RETRIED_METHODS)
    assert all(name["service"] == "kvcache.v1.KvCacheService" for name in method_config["name"])
    policy = method_config["retryPolicy"]
    assert policy["maxAttempts"] == 4
    assert policy["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert policy["initialBackoff"] == "0.05s" and policy["maxBackoff"] == "1s"


def test_request_ids_are_fresh_128_bit_hex():
    ids = {new_request_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_request_ids_are_stamped_once_where_the_request_has_the_field():
    request = with_request_id(pb.SnapshotRequest(cache_id="c"))
    assert len(request.request_id) == 32
    assert with_request_id(request).request_id == request.request_id
    assert with_request_id(pb.TrimRequest(request_id="mine")).request_id == "mine"
    assert with_request_id(pb.GetCacheRequest(cache_id="c")) == pb.GetCacheRequest(cache_id="c")


def test_metadata_carries_the_token_and_replica():
    assert channel.call_metadata(ClientOptions()) == ()
    assert channel.call_metadata(ClientOptions(token="t", replica="r1")) == (
        ("authorization", "Bearer t"), ("x-kvcache-replica", "r1"))


def test_channel_arguments_follow_the_options():
    args = dict(channel.channel_arguments(ClientOptions(max_message_bytes=1 << 20,
                                                        keepalive_time=0)))
    assert args["grpc.max_send_message_length"] == 1 << 20
    assert args["grpc.max_receive_message_length"] == 1 << 20
    assert "grpc.keepalive_time_ms" not in args
    args = dict(channel.channel_arguments(ClientOptions(
        keepalive_time=10, keepalive_timeout=5, dedicated_connection=True, tls=True,
        tls_server_name="kv.example", max_reconnect_backoff=2)))
    assert (args["grpc.keepalive_time_ms"], args["grpc.keepalive_timeout_ms"]) == (10000, 5000)
    assert args["grpc.use_local_subchannel_pool"] == 1
    assert args["grpc.ssl_target_name_override"] == "kv.example"
    assert args["grpc.max_reconnect_backoff_ms"] == 2000
    assert args["grpc.initial_reconnect_backoff_ms"] == 1000
