"""An Envoy stand-in for tests/epp.rs: speaks ext_proc to `tandem epp` with the grpc project's
generated Envoy protos (PyPI `xds-protos`, from envoyproxy/data-plane-api) over `grpcio`,
forwards picked requests to the chosen model server as a gateway would, and prints what it
saw as one JSON object. The Rust test makes the assertions; this script only fails on
protocol violations it cannot report (a missing answer, an unexpected message).

    python3 epp_client.py health EPP
    python3 epp_client.py prefix EPP METRICS
    python3 epp_client.py shed EPP
    python3 epp_client.py unavailable EPP
"""

import json
import queue
import random
import sys
import time
import urllib.request

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import json_format, struct_pb2

MODE = processing_mode_pb2.ProcessingMode
DESTINATION = "x-gateway-destination-endpoint"


def health(channel, service):
    """grpc.health.v1.Health/Check, encoded by hand (HealthCheckRequest{service = 1},
    HealthCheckResponse{status = 1}) so no generated health module is needed."""
    name = service.encode()
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=lambda s: b"\x0a" + bytes([len(s)]) + s if s else b"",
        response_deserializer=lambda b: b[1] if len(b) >= 2 and b[0] == 0x08 else 0,
    )
    try:
        status = check(name, timeout=5)
    except grpc.RpcError as e:
        return "error:" + e.code().name
    return {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}[status]


class Stream:
    """One ext_proc stream (one HTTP request), messages sent as the test decides."""

    def __init__(self, stub):
        self.q = queue.Queue()
        self.responses = stub.Process(iter(self.q.get, None))

    def send(self, msg):
        self.q.put(msg)

    def recv(self):
        return next(self.responses)

    def close(self):
        self.q.put(None)


def headers_msg(path, mode, end_of_stream=False, served=None):
    h = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
            base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
            base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
        ]
    )
    msg = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=h, end_of_stream=end_of_stream)
    )
    msg.protocol_config.request_body_mode = mode
    msg.protocol_config.response_body_mode = mode
    return msg


def served_metadata(msg, endpoint):
    md = struct_pb2.Struct()
    md.update({"x-gateway-destination-endpoint-served": endpoint})
    msg.metadata_context.filter_metadata["envoy.lb"].CopyFrom(md)


def observe(resp):
    """A routing answer as JSON-friendly data."""
    kind = resp.WhichOneof("response")
    if kind == "immediate_response":
        ir = resp.immediate_response
        return {
            "kind": "immediate",
            "status": ir.status.code,
            "body": json.loads(ir.body.decode() or "null"),
            "headers": {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers},
        }
    common = getattr(resp, kind).response
    header = [
        h.header.raw_value.decode()
        for h in common.header_mutation.set_headers
        if h.header.key == DESTINATION
    ]
    md = json_format.MessageToDict(resp.dynamic_metadata)
    return {
        "kind": kind,
        "header": header[0] if header else None,
        "metadata": md.get("envoy.lb", {}).get(DESTINATION),
        "clear_route_cache": common.clear_route_cache,
    }


def pick(stub, body, mode):
    """Sends one request's headers and body; the routing answer and the open stream."""
    s = Stream(stub)
    data = json.dumps(body).encode()
    s.send(headers_msg("/v1/completions", mode))
    if mode == MODE.BUFFERED:
        first = s.recv()
        assert first.WhichOneof("response") == "request_headers", first
        s.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=True)))
        answer = s.recv()
        return observe(answer), s, True
    # Full duplex: the body in two chunks, then the held headers answer and the body back.
    half = len(data) // 2
    s.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=data[:half])))
    s.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=data[half:], end_of_stream=True)))
    answer = s.recv()
    seen = observe(answer)
    if seen["kind"] == "immediate":
        return seen, s, False
    back = s.recv()
    sr = back.request_body.response.body_mutation.streamed_response
    return seen, s, sr.body == data and sr.end_of_stream


def forward(s, endpoint, body, mode):
    """Sends the request to the picked model server, as the gateway would, and passes its
    response through the stream (served endpoint in the metadata), then closes it."""
    req = urllib.request.Request(
        "http://%s/v1/completions" % endpoint,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        status, payload = r.status, r.read()
    msg = ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())]
            )
        )
    )
    served_metadata(msg, endpoint)
    s.send(msg)
    assert s.recv().WhichOneof("response") == "response_headers"
    s.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=payload, end_of_stream=True)))
    back = s.recv()
    assert back.WhichOneof("response") == "response_body"
    echoed = back.response_body.response.body_mutation.streamed_response.body
    s.close()
    return status, (mode != MODE.FULL_DUPLEX_STREAMED) or echoed == payload


def metric(addr, name):
    text = urllib.request.urlopen("http://%s/metrics" % addr, timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return None


def completion(prompt):
    return {"model": "mocker", "prompt": prompt, "max_tokens": 2, "temperature": 0}


def main():
    cmd, addr = sys.argv[1], sys.argv[2]
    channel = grpc.insecure_channel(addr)
    stub = ep_grpc.ExternalProcessorStub(channel)
    out = {}
    if cmd == "health":
        for name in ["liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"]:
            out[name] = health(channel, name)
    elif cmd == "prefix":
        metrics = sys.argv[3]
        prefix = list(range(1000, 1000 + 512))
        body = completion(prefix)
        first, s, echoed = pick(stub, body, MODE.FULL_DUPLEX_STREAMED)
        out["first"] = first
        out["first_body_echoed"] = echoed
        endpoint = first["header"].split(",")[0]
        status, passed = forward(s, endpoint, body, MODE.FULL_DUPLEX_STREAMED)
        out["first_status"], out["first_response_echoed"] = status, passed
        # The engine's KV events reach the picker's index: wait for the prompt's 32 blocks.
        deadline = time.time() + 20
        while (metric(metrics, "tandem_index_entries") or 0) < 32 and time.time() < deadline:
            time.sleep(0.05)
        out["index_entries"] = metric(metrics, "tandem_index_entries")
        # The same prefix again, in buffered mode, with another ending.
        second, s, _ = pick(stub, completion(prefix + [77, 78, 79]), MODE.BUFFERED)
        out["second"] = second
        s.close()
        rnd = random.Random(7)
        other, s, _ = pick(stub, completion([rnd.randrange(2000, 9000) for _ in range(300)]),
                           MODE.FULL_DUPLEX_STREAMED)
        out["other"] = other
        s.close()
    elif cmd == "shed":
        held = []
        for i in range(2):
            seen, s, _ = pick(stub, completion(list(range(3000 + 100 * i, 3064 + 100 * i))),
                              MODE.FULL_DUPLEX_STREAMED)
            out["held%d" % i] = seen
            held.append(s)
        shed, s, _ = pick(stub, completion(list(range(5000, 5064))), MODE.FULL_DUPLEX_STREAMED)
        out["shed"] = shed
        s.close()
        # One held request ends (its stream closes): capacity is back.
        held.pop(0).close()
        deadline = time.time() + 10
        while True:
            again, s, _ = pick(stub, completion(list(range(6000, 6064))),
                               MODE.FULL_DUPLEX_STREAMED)
            s.close()
            if again["kind"] != "immediate" or time.time() > deadline:
                break
            time.sleep(0.05)
        out["after_release"] = again
        for s in held:
            s.close()
    elif cmd == "unavailable":
        seen, s, _ = pick(stub, completion(list(range(100, 164))), MODE.FULL_DUPLEX_STREAMED)
        out["picked"] = seen
        s.close()
        for name in ["liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"]:
            out[name] = health(channel, name)
    else:
        raise SystemExit("unknown command " + cmd)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
