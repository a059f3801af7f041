"""An OTLP/gRPC trace receiver for tests/tracing.rs, independent of tandem's exporter: the
OpenTelemetry project's published protos (PyPI `opentelemetry-proto`) served with `grpcio`.

Usage: otlp_receiver.py PORT_FILE SPANS_FILE

Binds 127.0.0.1 on a free port, writes the port to PORT_FILE, and appends one JSON object
per received span to SPANS_FILE: trace and span ids (hex), parent span id, name, kind, the
resource's service.name, start/end times and the attributes as plain JSON values.
"""

import json
import sys
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def value(v):
    which = v.WhichOneof("value")
    if which == "array_value":
        return [value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return v.bytes_value.hex()
    if which is None:
        return None
    return getattr(v, which)


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, out):
        self.out = out
        self.lock = threading.Lock()

    def Export(self, request, context):
        lines = []
        for rs in request.resource_spans:
            resource = {kv.key: value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    lines.append(
                        json.dumps(
                            {
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(),
                                "name": span.name,
                                "kind": KINDS.get(span.kind, str(span.kind)),
                                "service": resource.get("service.name"),
                                "start": span.start_time_unix_nano,
                                "end": span.end_time_unix_nano,
                                "status": span.status.code,
                                "attributes": {kv.key: value(kv.value) for kv in span.attributes},
                            }
                        )
                    )
        with self.lock:
            with open(self.out, "a", encoding="utf-8") as f:
                for line in lines:
                    f.write(line + "\n")
        return trace_service_pb2.ExportTraceServiceResponse()


def main():
    port_file, spans_file = sys.argv[1], sys.argv[2]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(spans_file), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with open(port_file + ".tmp", "w", encoding="utf-8") as f:
        f.write(str(port))
    import os

    os.replace(port_file + ".tmp", port_file)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
