"""Python modules generated from proto/ by `python -m services.codegen` (run by deploy/bootstrap.sh).

Import them as `from services.pb.betelgeuse.v1 import inference_pb2, inference_pb2_grpc`. Only
`services/` imports these; `betelgeuse/` never sees protobuf.
"""
