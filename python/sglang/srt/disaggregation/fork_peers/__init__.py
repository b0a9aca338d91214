"""Peer liveness (fork): a lost prefill/decode peer, lost handshakes. `peer_monitor` (the shared core),
`prefill_side_monitor` + `held_decodes` (decode peers, as prefill sees them), `decode_side_monitor` (prefill peers,
as decode sees them), `peer_sockets` (upstream's per-peer sockets), `lost_handshake` (the lost-decode handshake
rule). docs/peer-liveness.md."""
