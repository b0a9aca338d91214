"""Peer liveness (fork): a lost prefill/decode peer, lost handshakes."""
