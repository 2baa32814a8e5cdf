"""Checkpoints the project builds itself: tiny random models for tests, and the default served model."""
