"""Trainers: one per policy. Never imports rollout; meets it in the protocol and weight channel."""
