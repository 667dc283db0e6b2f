"""model/layers.py check_token_ids: a list of Python ints (every pass's ids) is checked in Python, other inputs by
torch; both give the same LongTensor and the same error for a bad id."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from betelgeuse.errors import InvalidRequestError
from betelgeuse.model.layers import check_token_ids

V = 320


@pytest.mark.parametrize("ids", [[5], [0, 319, 7], list(range(3, 40))])
def test_a_list_of_ints_is_the_tensor_paths_ids(ids):
    got = check_token_ids(ids, V, torch.device("cpu"))
    want = check_token_ids(torch.tensor(ids), V, torch.device("cpu"))       # the torch path
    assert got.dtype == want.dtype == torch.long and torch.equal(got, want) and got.shape == (len(ids),)
    assert torch.equal(check_token_ids(np.array(ids), V, torch.device("cpu")), want)


@pytest.mark.parametrize("bad, named", [([3, V], V), ([-1, 4], -1), ([2, 10**30], 10**30)])
def test_a_bad_id_is_named_on_either_path(bad, named):
    with pytest.raises(InvalidRequestError, match=f"token id {named} is out of range"):
        check_token_ids(bad, V, torch.device("cpu"))
    if abs(named) < 2**63:
        with pytest.raises(InvalidRequestError, match=f"token id {named} is out of range"):
            check_token_ids(torch.tensor(bad), V, torch.device("cpu"))
    with pytest.raises(InvalidRequestError, match="no input tokens"):
        check_token_ids([], V, torch.device("cpu"))
