"""A small Python client for agents: stream a generation from a Betelgeuse server.

    from services.grpc.client import generate_stream
    for ev in generate_stream("127.0.0.1:50051", prompt_text="Hello", max_tokens=32,
                              api_key=os.environ.get("BETELGEUSE_API_KEY"), tls_ca=None):
        if ev.WhichOneof("event") == "token": print(ev.token.text, end="", flush=True)
        else: print(ev.final.tail); usage = ev.final.usage
"""

from __future__ import annotations

import grpc

from betelgeuse.errors import BetelgeuseError
from services.pb.betelgeuse.v1 import inference_pb2 as pb
from services.pb.betelgeuse.v1 import inference_pb2_grpc as pb_grpc


def channel(address: str, tls_ca: str | bytes | None = None, tls: bool = False) -> grpc.Channel:
    """A channel to HOST:PORT or unix:/path; TLS when `tls` or `tls_ca` (a PEM file or its bytes: the CA that signed
    the server's certificate; None with tls=True: the system's roots)."""
    if not (tls or tls_ca):
        return grpc.insecure_channel(address)
    if isinstance(tls_ca, str):
        try:
            with open(tls_ca, "rb") as f:
                tls_ca = f.read()
        except OSError as e:
            raise BetelgeuseError(f"TLS CA {tls_ca}: {e.strerror or e}") from None
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls_ca))


def credentials(api_key: str | None) -> list[tuple[str, str]] | None:
    """The metadata that carries an API key (what the server checks when [worker] api_keys is set)."""
    return [("authorization", f"Bearer {api_key}")] if api_key else None


def generate_stream(address: str, *, prompt_text=None, prompt_ids=None, messages=None, max_tokens=64, temperature=0.0,
                    top_k=0, top_p=1.0, seed=None, stop=(), stop_token_ids=(), ignore_eos=False, timeout=None,
                    api_key: str | None = None, tls_ca: str | bytes | None = None, tls: bool = False):
    sampling = pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if seed is not None:
        sampling.seed = seed
    req = pb.GenerateRequest(sampling=sampling, max_tokens=max_tokens, stop=list(stop),
                             stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    if prompt_ids is not None:
        req.prompt_ids.ids.extend(prompt_ids)
    elif messages is not None:
        req.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    else:
        req.prompt_text = prompt_text or ""
    with channel(address, tls_ca, tls) as ch:
        try:
            yield from pb_grpc.InferenceServiceStub(ch).Generate(req, timeout=timeout, metadata=credentials(api_key))
        except grpc.RpcError as e:
            raise BetelgeuseError(f"{address}: {e.code().name}: {e.details()}") from None
