"""Speculative decoding: drafts proposed for decoding sequences before a step, checked in the step's one
forward pass, and settled after it (speculator.py); where drafts come from (ngram.py, draft_model.py)."""
