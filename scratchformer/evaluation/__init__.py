"""Evaluation: batch inference over files of inputs (`predict`)."""
