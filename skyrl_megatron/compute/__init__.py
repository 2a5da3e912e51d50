"""Compute on a built model: micro-batch schedules, logprobs, losses."""
