"""How a PD request ends (fork): the room ledger and engine clock, end-cause tags and counters, the PD queue walker."""
