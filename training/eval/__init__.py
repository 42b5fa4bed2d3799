"""Evaluation of drafters against their target: τ, acceptance per position, calibration."""
