"""Closed-loop evaluation: a policy server over OpenPI's websocket + msgpack protocol, simulator adapters (a
registry), and rollouts in parallel worker processes that talk to the server with ``openpi-client``."""
