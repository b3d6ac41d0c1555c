"""The decode plan image's pinned host buffer (plan_buffers.HostImage) outlives an owner that goes
while the module's upload of it may still be in flight: torch's pinned-memory cache does not see
that copy, so a freed buffer could be refilled by another plan() under it."""

from __future__ import annotations

import torch

from attnforge import plan_buffers


class FakeEvent:
    """An upload's completion event: `done` says whether the copy has run."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def image(size: int, done: bool) -> plan_buffers.HostImage:
    img = plan_buffers.HostImage()
    img.host = torch.arange(size, dtype=torch.int32)
    img.upload_done = FakeEvent(done)
    return img


def test_an_image_dropped_under_its_upload_is_held_until_the_upload_ran(monkeypatch):
    retired = []
    monkeypatch.setattr(plan_buffers, "_RETIRED_HOST_IMAGES", retired)
    img = image(64, done=False)
    held = img.host
    img.retire()
    assert len(retired) == 1 and retired[0][0] is held
    other = image(64, done=True)
    other.buffer(64, stream=None)  # an upload still pending: the held buffer stays
    assert len(retired) == 1
    img.upload_done.done = True
    other.buffer(64, stream=None)  # its upload ran: released on the next plan()
    assert retired == []


def test_an_image_whose_upload_ran_is_not_held(monkeypatch):
    retired = []
    monkeypatch.setattr(plan_buffers, "_RETIRED_HOST_IMAGES", retired)
    image(64, done=True).retire()
    plan_buffers.HostImage().retire()  # never planned: nothing to hold
    assert retired == []


def test_a_buffer_is_refilled_only_after_its_last_upload_finished():
    img = image(64, done=False)
    buf = img.buffer(32, stream=None)
    assert img.upload_done.waited and buf is img.host  # large enough: the same memory, after the wait
