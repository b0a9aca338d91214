"""KV transfer guarantees (fork): the transfer deadline and its knob, chunk failures."""
