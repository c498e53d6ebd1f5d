"""Speculative decoding: proposers of draft tokens that the model verifies in one step."""
