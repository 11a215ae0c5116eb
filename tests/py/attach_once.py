#!/usr/bin/python3
"""attach_once.py SOCKET GROUP RANK NAME: Attach a client over the control RPC (without redeeming the
token) and print "client_id secret_hex pid". Used by the shell system tests to create daemon state."""
import os
import sys

sys.dont_write_bytecode = True
import epdtest  # noqa: E402

epd_pb2, epd_grpc, _, _ = epdtest.stubs()
import grpc  # noqa: E402

sock, group, rank, name = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with grpc.insecure_channel("unix:" + sock) as ch:
    a = epd_grpc.ControlStub(ch).Attach(
        epd_pb2.AttachRequest(protocol_version=epdtest.PROTOCOL_VERSION, group=group, rank=rank, num_experts=8,
                              hidden=128, topk=2, max_tokens=16, client_name=name, pid=4242), timeout=10)
print(a.client_id, a.secret.hex(), os.getpid())
