"""Placeholder training script for the golden job specs (only its path matters)."""
