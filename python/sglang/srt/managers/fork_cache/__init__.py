"""The prefix cache across weight updates: no request reads KV that weights other than its own wrote."""
