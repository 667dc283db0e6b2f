"""The store client's session messages built in place (services/grpc/store_client._load_request) against the same
messages made the plain protobuf way (a LoadRequest of ExpertIds, a ReleaseRequest, put in a SessionRequest's oneof):
equal fields, equal wire bytes, the oneof set, over random decode-sized and empty requests."""

from __future__ import annotations

import random

import pytest

from services.grpc.store_client import _load_request, _release_request
from services.pb.betelgeuse.v1 import store_pb2 as pb


def _reference(rid, kind, session, experts, release, ahead, drop):
    ids = lambda keys: [pb.ExpertId(layer=l, expert=e) for l, e in keys]       # noqa: E731
    req = pb.LoadRequest(session=session, experts=ids(experts), release=list(release), ahead=ids(ahead),
                         drop=ids(drop))
    return pb.SessionRequest(id=rid, **{kind: req})


@pytest.mark.parametrize("kind", ["load", "prefetch"])
def test_load_request_is_the_plain_message(kind):
    rng = random.Random(21)
    keys = lambda n: [(rng.randrange(61), rng.randrange(256)) for _ in range(n)]        # noqa: E731
    cases = [((), (), (), ()), ([(0, 0)], (), (), ())]          # a prefetch of nothing still names its kind
    for _ in range(300):
        cases.append((keys(rng.randrange(5)), [rng.randrange(64) for _ in range(rng.randrange(4))],
                      keys(rng.randrange(9)) if kind == "load" else (), keys(rng.randrange(4))))
    for i, (experts, release, ahead, drop) in enumerate(cases):
        rid, session = rng.randrange(1, 2**40), rng.choice(["", "s-1f3a"])
        got = _load_request(rid, kind, session, experts, release, ahead, drop)
        want = _reference(rid, kind, session, experts, release, ahead, drop)
        assert got.WhichOneof("kind") == kind, (i, got)
        assert got == want, (i, got, want)
        assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True), i


def test_release_request_is_the_plain_message():
    rng = random.Random(22)
    for i in range(200):
        rid, session = rng.randrange(1, 2**40), rng.choice(["", "s-1f3a"])
        slots = [rng.randrange(64) for _ in range(rng.randrange(6) if i else 0)]
        got = _release_request(rid, session, slots)
        want = pb.SessionRequest(id=rid, release=pb.ReleaseRequest(session=session, staging_slots=slots))
        assert got.WhichOneof("kind") == "release", (i, got)
        assert got == want, (i, got, want)
        assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True), i
