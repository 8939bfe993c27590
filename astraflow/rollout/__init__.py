"""Rollout: engines, the episode runner and the rollout worker process.

Never imports the trainer; meets it only in the protocol and the weight channel.
"""
