"""The weight channel between trainers and rollout engines."""
