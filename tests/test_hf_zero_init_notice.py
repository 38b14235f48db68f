"""``deepspeed.zero.Init`` on torsh builds whole parameters: the ways the built model can differ from DeepSpeed's
(initialisation after construction, torch RNG use) are said once, when a model was first built under it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_zero_init_says_once_how_the_built_model_differs_from_deepspeeds(caplog, monkeypatch):
    from torsh.compat.deepspeed.runtime.zero import partition_parameters as pp

    monkeypatch.setattr(pp, "_construction_warned", False)
    with caplog.at_level("WARNING", logger="torsh.compat"):
        with pp.Init():
            with pp.Init():  # nested (transformers nests it): said when the outermost one ends
                torch.nn.Linear(2, 2)
            assert "zero.Init" not in caplog.text
        with pp.Init():
            torch.nn.Linear(2, 2)
        with pp.Init(enabled=False):
            pass
    notices = [r for r in caplog.records if "deepspeed.zero.Init on torsh" in r.getMessage()]
    assert len(notices) == 1
    text = notices[0].getMessage()
    assert "_init_weights" in text and "random generator" in text and "set_seed" in text
