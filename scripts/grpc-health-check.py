#!/usr/bin/env python3
"""Calls grpc.health.v1.Health/Check three times with Python's grpcio (the C-core gRPC client)
and prints what it decodes: status, metadata, and the rich status (RetryInfo, QuotaFailure).

An interop check of the gRPC answers against a client this project did not write:
    python3 -m venv /tmp/pygrpc && /tmp/pygrpc/bin/pip install grpcio grpcio-health-checking grpcio-status
    /tmp/pygrpc/bin/python scripts/grpc-health-check.py [host:port]   # default 127.0.0.1:3000 (the demo)
"""
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from google.rpc import error_details_pb2
ch = grpc.insecure_channel(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:3000")
stub = health_pb2_grpc.HealthStub(ch)
for i in range(3):
    try:
        resp, call = stub.Check.with_call(health_pb2.HealthCheckRequest(service=""))
        md = dict(call.initial_metadata())
        print(i+1, "OK", health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status), "| ratelimit:", md.get("ratelimit"))
    except grpc.RpcError as e:
        print(i+1, e.code(), repr(e.details()))
        md = dict(e.trailing_metadata())
        print("   pushback-ms:", md.get("grpc-retry-pushback-ms"), "| retry-after:", md.get("retry-after"), "| ratelimit:", md.get("ratelimit"))
        st = rpc_status.from_call(e)
        for d in st.details:
            if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                r = error_details_pb2.RetryInfo(); d.Unpack(r); print("   RetryInfo:", r.retry_delay.seconds, "s", r.retry_delay.nanos, "ns")
            if d.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
                q = error_details_pb2.QuotaFailure(); d.Unpack(q)
                for v in q.violations: print("   QuotaFailure:", v.subject, "|", v.description, "|", v.quota_id, v.quota_value)
