#!/usr/bin/env python3
"""A decode message's encoding, us a call: the plain protobuf way main takes (a LoadRequest / ReleaseRequest of
ExpertIds put in a SessionRequest: upb copies each sub-message) against the store client's in-place builders
(services/grpc/store_client._load_request, _release_request). Decode-sized messages: a miss layer's Load (1 demand
load, 2 slots handed back, 3 guesses read ahead, 1 dropped), a read ahead (3 guesses, 1 dropped), a release of 2.

    PYTHONPATH=. python3 docs/benchmarks/cpu-host51/encode_bench.py"""

import json
import timeit

from services.grpc.store_client import _load_request, _release_request
from services.pb.betelgeuse.v1 import store_pb2 as pb

S, KEYS, AHEAD, DROP, REL = "s-1f3a", [(1, 5)], [(2, 3), (2, 7), (3, 1)], [(1, 4)], [3, 7]


def ids(keys):
    return [pb.ExpertId(layer=l, expert=e) for l, e in keys]


CASES = {
    "load": (lambda: pb.SessionRequest(id=3, load=pb.LoadRequest(session=S, experts=ids(KEYS), release=list(REL),
                                                                   ahead=ids(AHEAD), drop=ids(DROP))),
             lambda: _load_request(3, "load", S, KEYS, REL, AHEAD, DROP)),
    "prefetch": (lambda: pb.SessionRequest(id=3, prefetch=pb.LoadRequest(session=S, experts=ids(AHEAD), release=[],
                                                                           drop=ids(DROP))),
                 lambda: _load_request(3, "prefetch", S, AHEAD, [], (), DROP)),
    "release": (lambda: pb.SessionRequest(id=3, release=pb.ReleaseRequest(session=S, staging_slots=list(REL))),
                lambda: _release_request(3, S, list(REL))),
}


def main():
    out = {}
    for name, (plain, built) in CASES.items():
        assert plain() == built(), name
        out[name] = {k: round(min(timeit.repeat(f, number=3000, repeat=7)) / 3000 * 1e6, 2)
                     for k, f in (("plain_us", plain), ("in_place_us", built))}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
