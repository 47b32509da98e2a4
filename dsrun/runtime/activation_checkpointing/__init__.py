"""Activation checkpointing (`deepspeed.checkpointing`); see checkpointing.py."""
