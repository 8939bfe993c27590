"""The control-plane contracts: typed messages, signed msgpack envelopes, the client.

Imports nothing else from the package but `config`.
"""
