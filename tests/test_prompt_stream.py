"""PromptStream: a resumed stream trains every prompt of an epoch exactly once (< 1 s)."""

from __future__ import annotations

import random

import pytest

from areal_mega.data import PromptDataset, PromptStream


def _dataset(n: int = 10, seed: int = 3) -> PromptDataset:
    return PromptDataset([{"id": f"s{i}", "prompt": str(i)} for i in range(n)], seed=seed, shuffle=True)


@pytest.mark.parametrize("cut", [0, 3, 9, 10, 17, 25])
def test_resume_gives_back_in_flight_prompts_and_trains_each_once_per_epoch(cut: int) -> None:
    """Draw ``cut`` prompts, 'train' all but a random few (in flight at the checkpoint), resume
    a fresh stream from the state: over three epochs every id appears once per epoch."""
    rng = random.Random(cut)
    a = PromptStream(_dataset())
    drawn = [a.next() for _ in range(cut)]
    in_flight = sorted(rng.sample([p for p, _ in drawn], k=min(3, cut)))
    trained = [(p, s["id"]) for p, s in drawn if p not in in_flight]
    state = a.state_dict(in_flight)

    b = PromptStream(_dataset())
    b.load_state_dict(state)
    got = [b.next() for _ in range(30 - len(trained))]
    assert [p for p, _ in got[:len(in_flight)]] == in_flight  # given back first, in order
    trained += [(p, s["id"]) for p, s in got]
    for epoch in range(3):
        ids = sorted(i for (e, _), i in trained if e == epoch)
        assert ids == sorted(f"s{i}" for i in range(10)), (epoch, ids)


def test_uninterrupted_stream_equals_dataset_epochs() -> None:
    """Same order as iterating the dataset epoch after epoch (the controller's old path)."""
    d = _dataset()
    want = [s["id"] for _ in range(2) for s in d]
    s = PromptStream(_dataset())
    assert [s.next()[1]["id"] for _ in range(20)] == want


def test_resume_with_other_data_is_refused() -> None:
    state = PromptStream(_dataset(10)).state_dict([])
    with pytest.raises(ValueError, match="resume with the same data settings"):
        PromptStream(_dataset(11)).load_state_dict(state)
