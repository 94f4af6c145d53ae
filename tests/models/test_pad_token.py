"""One pad-id rule for the engine, the sub-agent and the tiny model."""

from types import SimpleNamespace

from lightning_agentrl.models import pad_token_id


def test_pad_id_zero_is_kept_and_a_missing_pad_falls_back_to_eos():
    assert pad_token_id(SimpleNamespace(pad_token_id=0, eos_token_id=2)) == 0
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=2)) == 2
    assert pad_token_id(SimpleNamespace(pad_token_id=5, eos_token_id=2)) == 5
