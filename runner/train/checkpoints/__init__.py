"""Checkpoints from the ranks' side, and what a completed run leaves: model.pt."""
