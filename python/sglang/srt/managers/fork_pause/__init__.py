"""Pause / release / resume in PD mode (fork): state, gate, aborts, the PD queues' buffers."""
