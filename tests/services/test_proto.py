"""The public proto: codegen runs in a fresh process, is idempotent and incremental, the generated
modules import under services.pb, and every field of the api.py dataclasses has a proto twin."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services import codegen

ROOT = Path(__file__).resolve().parents[2]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def test_codegen_cli_is_idempotent_and_incremental(tmp_path):
    out = tmp_path / "pb"
    run = [sys.executable, "-m", "services.codegen", "--out", str(out)]
    subprocess.run(run, cwd=ROOT, check=True, capture_output=True)
    first = _snapshot(out)
    assert "betelgeuse/v1/inference_pb2.py" in first and "betelgeuse/v1/inference_pb2_grpc.py" in first
    assert "betelgeuse/v1/inference_pb2.pyi" in first and "betelgeuse/v1/__init__.py" in first
    # the lead's store.proto (and any later .proto) is picked up without being named anywhere
    for rel in codegen.proto_files():
        assert f"{rel.with_suffix('')}_pb2.py" in first
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*.py")}

    # second run: outputs newer than inputs -> nothing rewritten
    r = subprocess.run(run, cwd=ROOT, check=True, capture_output=True, text=True)
    assert "wrote" not in r.stderr
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.py")} == mtimes

    # forced regeneration writes byte-identical files
    subprocess.run(run + ["--force"], cwd=ROOT, check=True, capture_output=True)
    assert _snapshot(out) == first

    # a touched .proto makes it regenerate
    stale = out / "betelgeuse/v1/inference_pb2.py"
    os.utime(stale, ns=(0, 0))
    assert not codegen.up_to_date(out_root=out)
    assert codegen.generate(out_root=out)
    assert _snapshot(out) == first


def test_generated_imports_are_rewritten(tmp_path):
    written = codegen.generate(out_root=tmp_path / "pb", force=True)
    for f in written:
        for line in f.read_text().splitlines():
            s = line.strip()
            # no import may reach our own `betelgeuse` package by accident
            assert not s.startswith(("from betelgeuse", "import betelgeuse")), (f, line)


def test_repo_modules_import_and_register_the_service():
    codegen.generate()  # what deploy/bootstrap.sh does; a no-op when current
    from services.pb.betelgeuse.v1 import inference_pb2 as pb
    from services.pb.betelgeuse.v1 import inference_pb2_grpc as pb_grpc

    svc = pb.DESCRIPTOR.services_by_name["InferenceService"]
    assert svc.full_name == "betelgeuse.v1.InferenceService"
    assert pb.DESCRIPTOR.name == "betelgeuse/v1/inference.proto"
    methods = {m.name: m for m in svc.methods}
    assert set(methods) == {"Generate", "Tokenize", "Detokenize", "GetModelInfo", "GetServerInfo"}
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    assert hasattr(pb_grpc, "InferenceServiceServicer") and hasattr(pb_grpc, "InferenceServiceStub")
    assert hasattr(pb_grpc, "add_InferenceServiceServicer_to_server")

    req = pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=[1, 2, 3]), max_tokens=5)
    req.sampling.seed = 7
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back.WhichOneof("prompt") == "prompt_ids" and list(back.prompt_ids.ids) == [1, 2, 3]
    assert back.HasField("max_tokens") and back.sampling.HasField("seed")
    assert not back.sampling.HasField("top_p")  # unset -> api default 1.0
    assert pb.FinishReason.Value("FINISH_REASON_LENGTH") == 2


def _api_classes():
    from betelgeuse import api
    return {name: obj for name, obj in vars(api).items()
            if dataclasses.is_dataclass(obj) and obj.__module__ == api.__name__}


@pytest.mark.parametrize("name", sorted(_api_classes()))
def test_every_api_field_has_a_proto_counterpart(name):
    from services.pb.betelgeuse.v1 import inference_pb2 as pb

    cls = _api_classes()[name]
    assert name in pb.DESCRIPTOR.message_types_by_name, f"api.{name} has no proto message {name}"
    msg = pb.DESCRIPTOR.message_types_by_name[name]
    api_fields = {f.name for f in dataclasses.fields(cls)}
    proto_fields = {f.name for f in msg.fields}  # oneof members are fields too
    assert api_fields == proto_fields, (
        f"{name}: only in api.py {sorted(api_fields - proto_fields)}, only in proto {sorted(proto_fields - api_fields)}")


def test_api_finish_reasons_map_onto_the_enum():
    from services.pb.betelgeuse.v1 import inference_pb2 as pb

    for reason in ("stop", "length", "cancelled", "tool_calls"):  # api.FinalEvent.finish_reason values
        assert pb.FinishReason.Value("FINISH_REASON_" + reason.upper()) > 0
